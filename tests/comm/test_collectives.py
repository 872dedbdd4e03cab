"""Collectives on real gloo ranks: averages, identical replicas, flags, variable sizes."""
from __future__ import annotations

import math
import weakref
from typing import List

import pytest
import torch
import torch.distributed as dist

import gradzip
from gradzip import codec, collectives
from gradzip.comm.stages import drive
from gradzip.codecs.base import SEED, Codec, Meta, Option, Payload, float_in
from gradzip.kernels import shared_generator

from ..dist_utils import run_workers


def _gather(t: torch.Tensor, world: int) -> List[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous())
    return out


def _pairs():
    return [(name, coll) for name in gradzip.codecs.names() for coll in gradzip.codec(name).collectives]


def _run_all_pairs(rank: int, world: int) -> dict:
    """Every (codec, collective) pair on the same inputs; returns what the parent asserts on."""
    out = {}
    for name, coll in _pairs():
        codec = gradzip.codec(name)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(37, 29, generator=g) * (1 + rank)  # odd size, different on every rank
        res = collectives.get(coll)(None).run(codec, x, "w", 0, need_own=True)
        avgs = _gather(res.avg, world)
        owns = torch.stack(_gather(res.own, world))
        out[(name, coll)] = {
            "identical": all(torch.equal(avgs[0], a) for a in avgs),
            "avg": res.avg,
            "owns": owns,
            "nonfinite": bool(res.nonfinite),
            "wire": res.wire_bytes,
        }
    return out


MAJORITY_VOTE = {"signsgd", "signum"}


def _reference(name: str, owns: torch.Tensor) -> torch.Tensor:
    if name in MAJORITY_VOTE:
        return owns.sum(0).sign()
    return owns.mean(0)


def sketch_bound(values: torch.Tensor, buckets: int = 256) -> float:
    """Largest error of one sketchml encode of ``values``: the widest quantile bucket.

    A bucket holds one sketch cell (2**-9 relative wide) plus at most ``ceil(n / (nb - 1))``
    further values in sorted order, so it spans at most that many sorted values (doubled here
    for margin) plus one cell.
    """
    v = values.double().reshape(-1).sort().values
    n = v.numel()
    if n < 2:
        return 1e-6
    nb = max(2, min(buckets, n))
    m = 2 * math.ceil(n / (nb - 1)) + 2
    spread = (v[-1] - v[0]) if m >= n else (v[m:] - v[:-m]).max()
    return spread.item() + 2**-8 * v.abs().max().item() + 1e-6


def _sra_chunks(ref: torch.Tensor, world: int) -> List[torch.Tensor]:
    """The chunks SRA re-encodes: ``ceil(n / W)`` values each, the last padded with zeros."""
    flat = ref.reshape(-1)
    chunk = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(chunk * world - flat.numel())])
    return list(padded.view(world, chunk))


def _tolerance(name: str, coll: str, owns: torch.Tensor, world: int, ref: torch.Tensor) -> float:
    scale = owns.abs().max().item()
    name = name[3:] if name.startswith("cl_") else name  # CompLL twins quantise like the originals
    if coll == "sra":  # the averaged chunk is quantised a second time
        if name == "maxmin":
            return (ref.max() - ref.min()).item() / (2**4 - 1) + 1e-6
        if name == "qsgd":
            return torch.linalg.vector_norm(ref).item() / (2**3 - 1) + 1e-6
        if name == "sketchml":  # each value becomes the mean of its bucket in its chunk
            return max(sketch_bound(c) for c in _sra_chunks(ref, world)) + 2 * world * 1e-6 * scale
        # terngrad decodes v to 0 or ±max|chunk|: |Q(v) − v| ≤ max|ref|. natural decodes it to
        # one of the powers of two 2**a ≤ |v| < 2**(a+1), so |Q(v) − v| < 2**a ≤ |v|, or (far
        # below the chunk's max) to 0 or a power under 2**-124 · max|chunk|: again ≤ max|ref|
        if name in ("terngrad", "natural"):
            return ref.abs().max().item() * (1 + 1e-6) + 1e-6
        # u8bit: nearest dynamic-tree entry times the bucket's max|v|; the widest gap between
        # entries is 0.9 / 64 (top decade), so |Q(v) − v| ≤ 0.9 / 128 · max|ref|, reached when
        # the bucket's max is negative (−1 decodes to −0.99297); 2**-20 covers fp32 rounding
        if name == "u8bit":
            return (0.9 / 128 + 2**-20) * ref.abs().max().item() + 1e-6
        # fp8: half an element step at the top of a block, 2**-4 (e4m3) of its max; MX also
        # saturates the top of its range, [448, 512) or [6, 8) times the shared scale
        if name in ("fp8", "mxfp8", "mxfp4"):
            return {"fp8": 2**-4, "mxfp8": 2**-3, "mxfp4": 2**-2}[name] * ref.abs().max().item() * (1 + 1e-6) + 1e-6
    eps = {"fp16": 2**-10, "bf16": 2**-7}.get(name, 1e-6)
    return 2 * world * eps * scale + 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_averages_decoded_payloads(world):
    results = run_workers(_run_all_pairs, world)
    failures = []  # every pair is checked, and all failures are reported together
    for key, rec in results[0].items():
        name, coll = key
        if not all(r[key]["identical"] and torch.equal(r[key]["avg"], rec["avg"]) for r in results):
            failures.append(f"{key}: ranks disagree")
        ref = _reference(name, rec["owns"])
        tol = _tolerance(name, coll, rec["owns"], world, ref)
        err = (rec["avg"] - ref).abs().max().item()
        if not err <= tol:
            failures.append(f"{key}: |avg - mean(decoded)| = {err} > {tol}")
        if rec["nonfinite"]:
            failures.append(f"{key}: finite input flagged non-finite")
        codec = gradzip.codec(name)
        if coll != "sra":
            bound = codec.wire_bytes(37 * 29, torch.float32, shape=(37, 29))
            if not (rec["wire"] == bound if codec.fixed_size else rec["wire"] <= bound):
                failures.append(f"{key}: {rec['wire']} wire bytes, wire_bytes() says {bound}")
    assert not failures, "\n".join(failures)


def _nonfinite(rank: int, world: int) -> dict:
    out = {}
    pairs = [("none", "allreduce"), ("randomk", "allreduce"), ("topk", "allgather"), ("signsgd", "allgather")]
    pairs += [("threshold", "allgather")]  # payloads of a size of their own per rank: flags at other offsets
    pairs += [("maxmin", "sra"), ("sketchml", "ps"), ("onebit", "ps"), ("randomk", "ps"), ("powersgd", "allreduce")]
    pairs += [("qsgd", "ps")]  # in three partitions, the NaN in the last one
    # finite, but PowerSGD's products of it overflow: flagged like a NaN
    pairs += [("powersgd", "allreduce", "overflow")]
    for name, coll, *spoil in pairs:
        options = {"threshold": 1.5} if name == "threshold" else {}  # about 13% of the values pass
        if name == "qsgd":  # (8 bits: the residual of 4 is not bounded, see QSGD.memory_problem)
            options.update(bits=8, collective_options={"partitions": 3, "min_partition": 1})
        comm = gradzip.Communicator(name, collective=coll, memory="residual", **options)
        x = torch.randn(64, 40, generator=torch.Generator().manual_seed(rank))
        if name == "threshold":
            x[: rank + 1] *= 4  # more values pass on later ranks: every rank's payload is sized apart
        first = comm.allreduce(x, name="w")
        before = comm.memory.residuals["w"].clone()
        bad = x.clone()
        if rank == 1 and spoil:
            bad.fill_(3e38)  # P = M Q overflows on this rank, and with it every later round's sums
        elif rank == 1:
            bad[3 if name != "qsgd" else 60, 5] = float("nan")
        second = comm.allreduce(bad, name="w")
        after = comm.memory.residuals["w"].clone()  # updated in place at the next step
        third = comm.allreduce(x, name="w")
        out["/".join([name, coll, *spoil])] = {
            "first_finite": bool(torch.isfinite(first).all()),
            "second_all_nan": bool(torch.isnan(second).all()),
            "memory_kept": torch.equal(before, after),
            "third_finite": bool(torch.isfinite(third).all()),
        }
        comm.close()
    return out


def test_nonfinite_input_on_one_rank_reaches_every_rank_and_spares_memory():
    for rank, res in enumerate(run_workers(_nonfinite, 3)):
        for name, rec in res.items():
            assert rec == {"first_finite": True, "second_all_nan": True, "memory_kept": True, "third_finite": True}, (rank, name, rec)


def _second_round_overflow(rank: int, world: int) -> dict:
    from gradzip.sync.pipeline import drive

    shapes, names = [(64, 40), (32, 16), (48, 24)], [f"l{i}.weight" for i in range(3)]
    out = {}
    for batched in (False, True):
        comm = gradzip.Communicator("powersgd", rank=2)
        g = torch.Generator().manual_seed(rank)
        steps = []
        for step in range(4):
            grads = [torch.randn(s, generator=g) for s in shapes]
            if step == 1 and rank == 1:  # one large column: P = M Q stays finite, Mᵀ P̂ does not
                grads[0].zero_()
                grads[0][:, 0] = 2e38
            if batched:  # one all-reduce per round for the three, one flag
                avgs = drive(comm.reduce_many_stages(grads, names, [True] * 3, groups=[[i] for i in range(3)], step=step))
            else:
                avgs = [comm.allreduce(t, name=n) for t, n in zip(grads, names)]
            steps.append({"avgs": avgs, "residuals": {n: r.clone() for n, r in comm.memory.residuals.items()}})
        out[batched] = steps
        comm.close()
    return out


def test_a_finite_gradient_whose_second_round_overflows_is_flagged_like_a_nan():
    """PowerSGD's second round, Q = Mᵀ P̂, can overflow where the input and P = M Q are finite:
    its sums are read, so the step's averages are NaN on every rank (all three matrices where
    they share a flag), every residual is kept, and the steps after it are finite."""
    results = run_workers(_second_round_overflow, 2)
    for res in results:
        for batched, steps in res.items():
            spoiled = [0, 1, 2] if batched else [0]
            assert [bool(a.isnan().all()) for a in steps[1]["avgs"]] == [i in spoiled for i in range(3)], batched
            for n in ("l0.weight",) + (("l1.weight", "l2.weight") if batched else ()):
                assert torch.equal(steps[1]["residuals"][n], steps[0]["residuals"][n]), (batched, n)
            assert all(bool(a.isfinite().all()) for s in steps[2:] for a in s["avgs"]), batched
            assert all(bool(r.isfinite().all()) for r in steps[3]["residuals"].values()), batched
    for batched in (False, True):
        assert all(torch.equal(x, y) for x, y in zip(results[0][batched][3]["avgs"], results[1][batched][3]["avgs"]))


def _large_finite(rank: int, world: int) -> dict:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Divisions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("div_", "div"):
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    out = {}
    for name in ("maxmin", "qsgd"):
        for collective in ("sra", "allgather", "ps"):
            comm = gradzip.Communicator(name, collective=collective)
            x = torch.full((4096,), 3.0e38) * (1 - 0.01 * rank)  # finite; the sum of two is not
            with Divisions() as divisions:
                avg = comm.allreduce(x, name="w")
            out[name, collective] = {"avg": avg, "divided": divisions.sizes}
            comm.close()
    return out


def test_sra_allgather_and_ps_average_large_finite_values_without_overflow_or_a_division_pass():
    """Max-min and QSGD average the received payloads by dividing their statistics by W and
    summing, in the SRA, the all-gather and the parameter server's aggregation: values near
    fp32's largest average to a finite value close to the mean (a sum first would be inf), and
    no division runs over the average."""
    results = run_workers(_large_finite, 2)
    for res in results:
        for (name, collective), rec in res.items():
            avg = rec["avg"]
            assert bool(avg.isfinite().all()), (name, collective)
            # max-min is exact on a constant bucket; QSGD's 4-bit levels are a seventh of a norm apart
            assert float((avg / 2.985e38 - 1).abs().max()) < (0.05 if name == "maxmin" else 0.5), (name, avg[:4])
            assert max(rec["divided"], default=0) < 4096 // 2 // 8, (name, collective, rec["divided"])  # statistics only
    for key in results[0]:
        assert torch.equal(results[0][key]["avg"], results[1][key]["avg"])


def _cast_beyond_range(rank: int, world: int) -> dict:
    out = {}
    # (bf16 beyond its range is near fp32's largest, where the all-gather's fp32 sum of decoded
    # payloads overflows first: the all-reduce alone there)
    for name, big, colls in (("fp16", 70000.0, ("allreduce", "allgather", "ps")), ("bf16", 3.4e38, ("allreduce", "ps"))):
        for collective in colls:
            comm = gradzip.Communicator(name, collective=collective)
            x = torch.tensor([big, -big, 1.0, big / 4])  # finite; fp16 cannot hold the first two
            out[name, collective, "alone"] = comm.allreduce(x, name="w")
            # two tensors side by side, each alone in its group: one batch (summed packed)
            pair = [x.clone(), x[:3].clone()]
            drive(comm.reduce_many_stages(pair, ["a", "b"], [True, True], inplace=True, groups=[[0], [1]], step=0))
            out[name, collective, "batch"] = pair[0]
            comm.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_cast_averages_values_beyond_its_range_to_its_largest_not_to_inf(world):
    """fp16's and bf16's payloads are each rank's share, saturated, yet the sum of the shares
    can pass the type's range where the average does: through the all-reduce (alone and in a
    batch) and the parameter server's sums, as through the all-gather, such an average comes
    back as the type's largest value of its sign, not as ±inf, the same on every rank."""
    results = run_workers(_cast_beyond_range, world)
    for key, avg in results[0].items():
        name = key[0]
        top = torch.finfo(torch.float16 if name == "fp16" else torch.bfloat16).max
        assert bool(avg.isfinite().all()), (key, avg)
        assert avg[0] == top and avg[1] == -top, (key, avg)
        assert torch.equal(avg, results[1][key])


def test_one_or_two_ranks_take_the_all_gather_where_the_codec_would_take_the_sra():
    """At two ranks the SRA's two rounds move what one all-gather moves, and at one the SRA
    would quantise twice: a codec whose own collective is the SRA gets the all-gather when none
    is named; at larger world sizes, and for codecs whose own is another, the codec's own."""
    from gradzip.comm.allgather import default_collective

    for name in ("maxmin", "fp8", "mxfp4"):
        c = codec(name)
        assert c.collective == "sra"
        assert [default_collective(c, w) for w in (1, 2)] == ["allgather"] * 2
        assert [default_collective(c, w) for w in (3, 4, 8)] == ["sra"] * 3
    for name, own in (("qsgd", "allgather"), ("fp16", "allreduce"), ("powersgd", "allreduce"), ("topk", "allgather")):
        assert default_collective(codec(name), 2) == own


def _staged_default(rank: int, world: int) -> dict:
    comm = gradzip.Communicator("maxmin", bits=4)
    named = gradzip.Communicator("maxmin", bits=4, collective_options={"segment": 1024})  # the SRA's option
    x = torch.randn(4096, generator=torch.Generator().manual_seed(rank))
    out = torch.empty_like(x)
    stages = comm.collective.stages(comm.codec, x, "w", 0, need_own=False, out=out)
    next(stages)  # it yields while its payloads are on the wire (a pipeline works meanwhile)
    res = drive(stages)
    names = (comm.collective_name, named.collective_name)
    comm.close()
    named.close()
    return {"names": names, "avg": res.avg, "in_out": res.avg.data_ptr() == out.data_ptr(), "x": x}


def _segmented(rank: int, world: int) -> dict:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in ("maxmin", "efsignsgd"):
        for segment in (None, 1024):
            coll = collectives.get("allgather")(None, segment=segment)
            res = coll.run(codec(name), x, "w", 3, need_own=True, out=torch.empty_like(x))
            out[name, segment] = {"avg": res.avg, "own": res.own, "wire": res.wire_bytes}
    c = codec("maxmin", bucket_size=1000)  # segments of 1024 values cut on its buckets: 1000
    res = collectives.get("allgather")(None, segment=1024).run(c, x, "w", 3, need_own=False)
    return {"x": x, "out": out, "odd_bucket_wire": (res.wire_bytes, c.wire_bytes(x.numel()))}


def test_the_all_gather_pipelines_segments_of_a_block_codec_and_sends_others_whole():
    """With ``segment`` the all-gather encodes and sends a block codec's tensor in pieces (each
    on the wire while the next is encoded): every rank gets the same average, close to the
    mean, and its own payloads for error feedback cover the whole tensor. A codec whose
    encoding depends on the whole tensor (EF-signSGD's scale, the mean magnitude) is sent whole
    whatever the option."""
    results = run_workers(_segmented, 2)
    mean = (results[0]["x"] + results[1]["x"]) / 2
    for r in results:
        cut, whole = r["out"]["maxmin", 1024], r["out"]["maxmin", None]
        assert float((cut["avg"] - mean).abs().max()) < 0.5 and not torch.equal(cut["avg"], whole["avg"])
        step = float(r["x"].max() - r["x"].min()) / 15  # 4 bits: one level at most, stochastically
        assert float((cut["own"] - r["x"]).abs().max()) <= step  # this rank's own, every segment
        assert cut["wire"] == whole["wire"]  # ten one-bucket segments: the same ten buckets
        assert torch.equal(r["out"]["efsignsgd", 1024]["avg"], r["out"]["efsignsgd", None]["avg"])
        got, whole = r["odd_bucket_wire"]
        assert got == whole  # no bucket split by a segment's end
    for key in results[0]["out"]:
        assert torch.equal(results[0]["out"][key]["avg"], results[1]["out"][key]["avg"]), key


def _released_in_place(rank: int, world: int) -> dict:
    """In place (``out`` is the input) with an ``on_release`` that reads the input and this
    rank's own payloads, as the engine's error feedback does, at each segment size; rank 1's
    input holds a NaN in its first segment in the second case."""
    out = {}
    for segment, nan in ((None, False), (1000, False), (1000, True)):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
        if nan and rank == 1:
            x[10] = float("nan")
        original, seen = x.clone(), {}

        def on_release(call, nonfinite):
            seen["x"] = call.x.clone()
            own = torch.zeros(call.x.numel())
            call.decode_own_into(own)
            seen["own"], seen["flag"] = own, bool(nonfinite)

        coll = collectives.get("allgather")(None, segment=segment)
        res = drive(coll.stages(codec("maxmin"), x, "w", 0, need_own=True, out=x, on_release=on_release))
        out[segment, nan] = {**seen, "original": original, "avg": res.avg.clone(), "in_place": res.avg.data_ptr() == x.data_ptr(),
                             "poisoned": res.poisoned}
    return out


def test_the_all_gather_releases_the_input_before_it_writes_the_average_over_it():
    results = run_workers(_released_in_place, 2)
    for r in results:
        for (segment, nan), rec in r.items():
            assert torch.equal(rec["x"].nan_to_num(), rec["original"].nan_to_num()), (segment, nan)  # intact when released
            # (poisoned: the flag went into the statistics, so the engine need not fill the average)
            assert rec["in_place"] and rec["flag"] == nan and rec["poisoned"]
            if nan:
                assert bool(rec["avg"].isnan().all())  # every segment, the one without the NaN too
            else:
                step = float(rec["original"].max() - rec["original"].min()) / 15
                assert float((rec["own"] - rec["original"]).abs().max()) <= step  # its own payloads, whole
    for key in results[0]:
        assert torch.equal(results[0][key]["avg"], results[1][key]["avg"]) or key[1]


def test_the_all_gather_yields_while_on_the_wire_and_decodes_into_out():
    results = run_workers(_staged_default, 2)
    for r in results:
        assert r["names"] == ("allgather", "sra"), r["names"]
        assert r["in_out"]  # summed where the average goes: no tensor of its size made
        mean = (results[0]["x"] + results[1]["x"]) / 2
        assert float((r["avg"] - mean).abs().max()) < 0.5  # 4-bit max-min of N(0, 1) values
    assert torch.equal(results[0]["avg"], results[1]["avg"])


def _gathered_in_place(rank: int, world: int, collective: str = "allgather") -> dict:
    coll = collectives.get(collective)(None)
    lent = []
    lend = coll._lend
    coll._lend = lambda call, shape, device: lent.append(shape) or lend(call, shape, device)
    c = codec("maxmin", bits=4, mode="nearest")  # deterministic: encoded again below
    g = torch.Generator().manual_seed(rank)
    out = {"steps": []}
    for step in range(2):
        x = torch.randn(3000, generator=g) * (rank + 1)
        if step == 1 and rank == 1:
            x[5] = float("nan")  # a non-finite step: the average poisoned, this rank's own payload not
        lent.clear()
        res = coll.run(c, x.clone(), "w", step, need_own=True, out=torch.empty_like(x))
        sent = c.decode(c.encode(x, "w", step)).reshape(-1)  # what this rank's payload decodes to
        out["steps"].append({"lent": list(lent), "own_as_sent": torch.equal(res.own.nan_to_num(7.0), sent.nan_to_num(7.0)), "avg": res.avg,
                             "nonfinite": bool(res.nonfinite)})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_all_gather_sends_from_its_own_row_and_leaves_the_own_payload_as_sent(world):
    """This rank's message is encoded into its own row of the gathered messages and sent from
    there (no send buffer beside the W rows); dividing the statistics by W and poisoning a
    non-finite step work on a copy of the statistics (lent by the pool, as the rows are), so the
    own payload that error feedback decodes is the one sent, on a finite step and a non-finite
    one."""
    results = run_workers(_gathered_in_place, world)
    for res in results:
        for step in res["steps"]:
            # the W rows, and a copy of their statistics (a few values a block): no send buffer
            # (besides the fp32 values this rank's own payload is decoded into for its memory)
            gathered = [shape for shape in step["lent"] if shape != (3000 * 4,)]
            assert len(gathered) == len(step["lent"]) - 1, step["lent"]
            rows, *rest = gathered
            assert all(len(shape) == 2 and shape[0] == world for shape in gathered), step["lent"]
            assert sum(shape[1] for shape in rest) * 16 < rows[1], step["lent"]
            assert step["own_as_sent"]
        assert not res["steps"][0]["nonfinite"] and res["steps"][1]["nonfinite"]
        assert res["steps"][0]["avg"].isfinite().all() and res["steps"][1]["avg"].isnan().all()
    assert all(torch.equal(r["steps"][0]["avg"], results[0]["steps"][0]["avg"]) for r in results)


def _gathered_variable(rank: int, world: int) -> dict:
    from ..tensors import LargestMade

    coll = collectives.get("allgather")(None)
    c = codec("threshold", threshold=0.5)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)  # more sent on later ranks
    with LargestMade((torch.uint8,)) as made:
        res = coll.run(c, x.clone(), "w", 0, need_own=True)
    return {"bytes": made.nbytes, "gathered": made.numel, "own": res.own, "avg": res.avg,
            "sent": c.decode(c.encode(x, "w", 0)).reshape(-1), "nonfinite": bool(res.nonfinite)}


@pytest.mark.parametrize("world", [2, 3])
def test_payloads_of_data_dependent_size_are_gathered_in_place_from_this_ranks_row(world):
    """A payload whose size depends on the data is written into this rank's row of the gathered
    messages, each row padded to the longest (known from the lengths gathered first): the
    bytes made for the exchange are those rows and the payload as encoded (no message or
    padded copy beside them); the own payload is the one sent, and every rank averages the same
    payloads: each rank's, decoded."""
    results = run_workers(_gathered_variable, world)
    sent = [codec("threshold", threshold=0.5).decode(codec("threshold", threshold=0.5).encode(
        torch.randn(3000, generator=torch.Generator().manual_seed(r)) * (r + 1), "w", 0)).reshape(-1) for r in range(world)]
    for res in results:
        # the W rows (the largest bytes made) and the pool's buffer (a size class: at most 19% over)
        # that this rank's own payload is decoded into, fp32 values
        assert res["bytes"] <= res["gathered"] + 3000 * 4 * 6 // 5, (res["bytes"], res["gathered"])
        assert torch.equal(res["own"], res["sent"]) and not res["nonfinite"]
        torch.testing.assert_close(res["avg"], sum(sent) / world)
        assert torch.equal(res["avg"], results[0]["avg"])


def _sixteen_bit_batch_settled(rank: int, world: int) -> list:
    from gradzip.comm import base

    out = []
    for name, dtype in (("bf16", torch.float16), ("fp16", torch.bfloat16), ("fp16", torch.float16)):
        xs = [torch.tensor([1e-7, 3e-6, 0.1, -7.3], dtype=dtype) * (rank + 1),
              torch.tensor([2e-7, 0.3], dtype=dtype) * (rank + 1)]
        residuals = [torch.zeros(x.numel()) for x in xs]  # fp32, as error feedback keeps them
        settles = [(lambda r: (lambda call, nonfinite: call.residual_into(r)))(r) for r in residuals]
        for single in (False, True):
            for r in residuals:
                r.zero_()
            if single:  # one call at a time
                for x, n, settle in zip(xs, ["a", "b"], settles):
                    drive(base.get("allreduce")().stages(codec(name), x, n, 0, True, on_release=settle))
            else:
                drive(base.get("allreduce")().stages_many(codec(name), xs, ["a", "b"], 0, True, [None, None],
                                                          on_release=settles))
            wire = torch.bfloat16 if name == "bf16" else torch.float16
            sent = [x.float() - (x / world).to(wire).float() * world for x in xs]
            out.append(all(torch.equal(r, e) for r, e in zip(residuals, sent)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_cast_of_sixteen_bit_inputs_settles_from_the_payload_it_sent(world):
    """With error feedback settled on release, this rank's share of a cast is the payload it
    sent, x / W rounded in the input's own dtype, then cast: for 16-bit inputs with an fp32
    residual, one call at a time (whose payload is encoded again at settle) and in a batch."""
    for res in run_workers(_sixteen_bit_batch_settled, world):
        assert all(res), res


def test_the_sra_gathers_the_averaged_chunks_from_its_own_row():
    """The SRA's second round sends this rank's re-encoded chunk from its own row of the
    gathered chunks: every buffer it is lent has W rows (the chunks sent, received and
    gathered), none is a send buffer of one chunk (the fp32 values this rank's own payloads are
    decoded into aside); a non-finite step still poisons the average."""
    for res in run_workers(_gathered_in_place, 3, "sra"):
        for step in res["steps"]:
            gathered = [shape for shape in step["lent"] if shape != (3000 * 4,)]
            assert len(gathered) == len(step["lent"]) - 1, step["lent"]
            assert all(len(shape) == 2 and shape[0] == 3 for shape in gathered), step["lent"]
        assert not res["steps"][0]["nonfinite"] and res["steps"][1]["nonfinite"]
        assert res["steps"][0]["avg"].isfinite().all() and res["steps"][1]["avg"].isnan().all()


def _own_aggregate(rank: int, world: int) -> dict:
    from gradzip.codecs.quantize import MaxMin

    class Summed(MaxMin):  # statistics that scale, and an aggregate of its own (the base one's values)
        name = "_test_summed"

        def aggregate(self, payloads, mean=True):
            return super().aggregate(payloads, mean)

    x = torch.full((4096,), 2.0 + rank)
    out = {}
    for coll in ("sra", "allgather"):
        res = collectives.get(coll)(None).run(Summed(bits=8), x, "w", 0, need_own=False, out=torch.empty_like(x))
        out[coll] = res.avg
    return out


def test_a_codec_with_its_own_aggregate_is_averaged_by_it_not_by_dividing_its_statistics():
    """Dividing the statistics by W assumes the base sum of decoded payloads; a codec with an
    aggregate of its own gets the plain average (not one divided by W twice)."""
    for res in run_workers(_own_aggregate, 2):
        for coll, avg in res.items():
            assert torch.allclose(avg, torch.full_like(avg, 2.5), atol=0.02), (coll, avg[:3])


class _NonZeros(Codec):
    """Test codec (not registered) with a data-dependent size: values above a threshold + indices."""

    name = "_test_nonzeros"
    collectives = ("allgather",)
    fixed_size = False
    options = {"threshold": Option(0.5, float_in(0.0, 100.0), "a float")}

    def _encode(self, x, meta: Meta):
        idx = (x.abs() > self.threshold).nonzero().reshape(-1)
        return [x[idx], idx.to(torch.int32)]

    def _decode(self, tensors, meta: Meta):
        values, idx = tensors
        return torch.zeros(meta.numel, dtype=values.dtype).index_copy_(0, idx.long(), values)

    def _wire_bytes(self, numel, dtype):
        return numel * 8  # an upper bound


def _variable(rank: int, world: int) -> dict:
    codec = _NonZeros(threshold=0.5)
    x = torch.zeros(1000)
    x[: 10 * (rank + 1)] = torch.arange(1, 10 * (rank + 1) + 1, dtype=torch.float32)  # sizes differ per rank
    res = collectives.get("allgather")(None).run(codec, x, "v", 0, need_own=True)
    return {"avg": res.avg, "x": x, "wire": res.wire_bytes}


def test_allgather_handles_payloads_of_different_sizes():
    results = run_workers(_variable, 3)
    expected = torch.stack([r["x"] for r in results]).mean(0)
    for r in results:
        assert torch.equal(r["avg"], expected)
    assert [r["wire"] for r in results] == [10 * (k + 1) * 8 for k in range(3)]


def _ordered_async(rank: int, world: int) -> bool:
    """Many calls in flight at once, of different sizes and codecs' collectives: all correct."""
    comms = [gradzip.Communicator("none"), gradzip.Communicator("topk", ratio=1.0, memory="none")]
    futures, expected = [], []
    for i in range(30):
        n = 1 + (i * 37) % 500
        t = torch.full((n,), float(rank + i))
        comm = comms[i % 2]
        futures.append(comm.allreduce_async(t, name=f"t{i}"))
        expected.append(sum(r + i for r in range(world)) / world)
    ok = all(torch.allclose(f.wait(), torch.full_like(f.wait(), e)) for f, e in zip(futures, expected))
    for c in comms:
        c.close()
    return ok


def test_async_calls_in_flight_complete_correctly():
    assert all(run_workers(_ordered_async, 4))


def test_impossible_combinations_are_rejected_at_construction():
    with pytest.raises(ValueError, match="allgather"):
        gradzip.Communicator("topk", collective="allreduce")
    with pytest.raises(ValueError, match="valid collectives: allgather, allreduce, ps, sra"):
        gradzip.Communicator("maxmin", collective="bogus")
    with pytest.raises(ValueError, match="valid collectives for it: allgather, ps, sra"):
        gradzip.Communicator("maxmin", collective="allreduce")
    with pytest.raises(ValueError, match="valid collectives for it: allreduce$"):
        gradzip.Communicator("powersgd", collective="ps")  # two rounds cannot pass an aggregator
    with pytest.raises(ValueError, match="unknown option\\(s\\) parts; valid options: min_partition, partitions"):
        gradzip.Communicator("maxmin", collective="ps", collective_options={"parts": 2})
    with pytest.raises(ValueError, match="partitions must be a positive integer"):
        gradzip.Communicator("maxmin", collective="ps", collective_options={"partitions": 0})
    with pytest.raises(ValueError, match="valid memories"):
        gradzip.Communicator("maxmin", memory="bogus")
    with pytest.raises(ValueError, match="valid codecs"):
        gradzip.Communicator("bogus")
    with pytest.raises(ValueError, match="bits"):
        gradzip.Communicator("maxmin", bits=9)


def test_single_process_communicator_round_trips():
    comm = gradzip.Communicator("maxmin", bits=8, memory="none")
    x = torch.randn(300, 7)
    y = comm.allreduce(x, name="w")
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max() <= (x.max() - x.min()) / 255 * 2 + 1e-6
    # the ratio counts one encoding of the tensor (sra's first round), rounded to 2 decimals
    assert comm.stats()["ratio"] == round(4 * x.numel() / comm.codec.wire_bytes(x.numel()), 2)
    comm.close()


# ================================================================================ PS (CaSync)
PS_CODECS = [
    ("none", {}),
    ("fp16", {}),
    ("maxmin", {}),
    ("signsgd", {}),
    ("sketchml", {}),
    ("inceptionn", {}),  # variable-size payloads: sizes exchanged in both phases
    ("randomk", {"scale": True}),  # summable: payloads summed at the aggregator, not re-encoded
]
PS_MIN_PARTITION = 4096


def _ps_sizes(world: int) -> List[int]:
    return [world * PS_MIN_PARTITION + 37, 35]  # W partitions, then a tiny tensor: one partition


def _run_ps(rank: int, world: int) -> dict:
    from gradzip.comm.ps import ParameterServer

    out = {}
    for name, opts in PS_CODECS:
        codec = gradzip.codec(name, **opts)
        ps = ParameterServer(None, min_partition=PS_MIN_PARTITION)
        for call, n in enumerate(_ps_sizes(world)):
            g = torch.Generator().manual_seed(100 * call + rank)
            x = torch.randn(n, generator=g) * (1 + rank)
            res = ps.run(codec, x, f"w{call}", 0, need_own=True)
            avgs = _gather(res.avg, world)
            out[(name, str(opts), call)] = {
                "identical": all(torch.equal(avgs[0], a) for a in avgs),
                "avg": res.avg,
                "owns": torch.stack(_gather(res.own, world)),
                "nonfinite": bool(res.nonfinite),
                "wire": res.wire_bytes,
                "aggregated": list(ps.aggregated),
            }
        # the same tensors in the other order (as DDP hands its buckets over in the first step after
        # a restart): the same aggregators, so the same averages, stochastic re-encodes included
        again, fresh = ParameterServer(None, min_partition=PS_MIN_PARTITION), gradzip.codec(name, **opts)
        for call, n in reversed(list(enumerate(_ps_sizes(world)))):
            x = torch.randn(n, generator=torch.Generator().manual_seed(100 * call + rank)) * (1 + rank)
            res = again.run(fresh, x, f"w{call}", 0, need_own=True)
            out[(name, str(opts), call, "reordered")] = torch.equal(res.avg, out[(name, str(opts), call)]["avg"])
        bad = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
        if rank == world - 1:
            bad[1234] = float("inf")
        out[(name, str(opts), "nonfinite")] = bool(ps.run(codec, bad, "bad", 0, need_own=False).nonfinite)
    # every codec PS supports: identical replicas, and a codec's own state (signum's momentum,
    # adaq's residual) sees this rank's partitions only, never the aggregate it re-encodes
    from gradzip.comm.ps import ParameterServer, num_partitions, partition_bounds

    for name in gradzip.codecs.names():
        codec = gradzip.codec(name)
        ps = ParameterServer(None, min_partition=256)
        if not ps.supports(codec):
            out[("supported", name)] = False
            continue
        x = torch.randn(1100, generator=torch.Generator().manual_seed(rank))
        res = ps.run(codec, x, "s", 3, need_own=True)
        local = gradzip.codec(name)
        for p, (a, b) in enumerate(partition_bounds(1100, num_partitions(1100, None, world, 256))):
            local.encode(x[a:b], f"s#{p}", 3)
        state, expected = codec.state_dict(), local.state_dict()
        avgs = _gather(res.avg, world)
        out[("supported", name)] = {
            "identical": all(torch.equal(avgs[0], a) for a in avgs),
            "finite": bool(torch.isfinite(res.avg).all()),
            "state": _same_state(state, expected),
        }
    return out


def _same_state(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _ps_tolerance(name: str, opts: dict, owns: torch.Tensor, world: int, ref: torch.Tensor, bounds) -> float:
    """|avg - ref| allowed after the aggregator's single re-encode of each averaged partition."""
    eps = 2 * world * {"fp16": 2**-10}.get(name, 1e-6) * owns.abs().max().item() + 1e-6
    parts = [ref[a:b] for a, b in bounds]
    if name == "maxmin":  # stochastic rounding: below one step of a bucket's range
        return max((p.max() - p.min()).item() for p in parts) / (2**4 - 1) + eps
    if name == "sketchml":  # dense: each value becomes the mean of its quantile bucket
        return max(sketch_bound(p) for p in parts) + eps
    if name == "inceptionn":  # error-bounded encoding: within error_bound of the average
        return gradzip.codec("inceptionn").error_bound + eps
    return eps  # none, fp16, randomk: summed payloads, decoded once


@pytest.mark.parametrize("world", [2, 4])
def test_ps_averages_with_round_robin_aggregators(world):
    from gradzip.comm.ps import ParameterServer, num_partitions, partition_bounds, rotation

    results = run_workers(_run_ps, world)
    for name, opts in PS_CODECS:
        codec = gradzip.codec(name, **opts)
        for call, n in enumerate(_ps_sizes(world)):
            key = (name, str(opts), call)
            rec = results[0][key]
            assert all(r[key]["identical"] and torch.equal(r[key]["avg"], rec["avg"]) for r in results), key
            parts = num_partitions(n, None, world, PS_MIN_PARTITION)
            assert parts == (world if call == 0 else 1)
            bounds = partition_bounds(n, parts)
            owns = rec["owns"]
            if name == "signsgd":  # majority vote; the re-encoded sign of a tie (0) is +1
                expected = torch.where(owns.sum(0) >= 0, 1.0, -1.0)
                assert torch.equal(rec["avg"], expected), key
            else:
                ref = owns.mean(0)
                tol = _ps_tolerance(name, opts, owns, world, ref, bounds)
                err = (rec["avg"] - ref).abs().max().item()
                assert err <= tol, f"{key}: |avg - mean(decoded)| = {err} > {tol}"
            assert not any(r[key]["nonfinite"] for r in results), key
            # partition p of tensor w at step s is aggregated by rank (hash(w) + s + p) mod W, exactly
            # once, whatever the order of the calls
            aggregated = [r[key]["aggregated"] for r in results]
            turn = rotation(f"w{call}", 0)
            assert aggregated == [[p for p in range(parts) if (turn + p) % world == r] for r in range(world)], key
            assert all(r[key + ("reordered",)] for r in results), key
            if call == 0:
                assert all(len(a) == 1 for a in aggregated), key  # W partitions: one per rank
            # wire: every partition up, the aggregated ones back
            for r, res in enumerate(results):
                sizes = [codec.wire_bytes(b - a, torch.float32) for a, b in bounds]
                bound = sum(sizes) + sum(sizes[p] for p in aggregated[r])
                if codec.fixed_size:
                    assert res[key]["wire"] == bound, (key, r)
                else:
                    assert res[key]["wire"] <= bound, (key, r)
        assert all(r[(name, str(opts), "nonfinite")] for r in results), f"{name}: non-finite flag lost"
    for name in gradzip.codecs.names():
        recs = [r[("supported", name)] for r in results]
        if not ParameterServer(None).supports(gradzip.codec(name)):  # refused, on every rank
            assert recs == [False] * world
            continue
        for rank, rec in enumerate(recs):
            assert rec == {"identical": True, "finite": True, "state": True}, (name, rank, rec)


def test_ps_aggregator_assignment_and_partitions():
    from gradzip.comm.ps import aggregator, num_partitions, partition_bounds, rotation

    assert [aggregator(0, p, 4) for p in range(4)] == [0, 1, 2, 3]
    assert [aggregator(1, p, 4) for p in range(4)] == [1, 2, 3, 0]
    assert [aggregator(c, 0, 3) for c in range(5)] == [0, 1, 2, 0, 1]  # one-partition tensors rotate
    assert [rotation("w", s) - rotation("w", 0) for s in range(3)] == [0, 1, 2]  # a step on, a rank on
    assert len({rotation(f"w{i}", 0) % 4 for i in range(16)}) > 1  # tensors start at different ranks
    for world in (1, 2, 3, 4):
        for call in range(2 * world):
            owners = [aggregator(call, p, world) for p in range(world)]
            assert sorted(owners) == list(range(world))  # K = W: every rank aggregates one
    assert num_partitions(10**6, None, 4, 4096) == 4
    assert num_partitions(10**6, 8, 4, 4096) == 8
    assert num_partitions(5000, None, 4, 4096) == 1
    assert num_partitions(0, None, 4, 4096) == 1
    assert num_partitions(3 * 4096, None, 4, 4096) == 3
    for n, k in [(10, 3), (4096 * 4 + 3, 4), (7, 1)]:
        bounds = partition_bounds(n, k)
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1


def test_ps_accepts_single_round_codecs_and_validates_options():
    from gradzip.comm.ps import ParameterServer

    ps = ParameterServer()
    # two rounds cannot pass an aggregator; a re-encode would cut a union of sparse selections
    # back to one selection, and would send nothing for tbq (an average lies inside τ)
    refused = {"powersgd", "topk", "threshold", "dgc", "graddrop", "adaq", "tbq", "cl_tbq"}
    assert {n for n in gradzip.codecs.names() if not ps.supports(gradzip.codec(n))} == refused
    assert not ps.supports(gradzip.codec("sketchml", ratio=0.1)) and ps.supports(gradzip.codec("sketchml"))
    for name in ("powersgd", "topk", "tbq"):
        with pytest.raises(ValueError, match=f"codec '{name}' cannot use collective 'ps'"):
            gradzip.Communicator(name, collective="ps")
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="partitions"):
            ParameterServer(partitions=bad)
    with pytest.raises(ValueError, match="min_partition"):
        ParameterServer(min_partition=0)
    # one process: the aggregator is this rank; the result is one encode + one re-encode away
    x = torch.randn(3 * 4096 + 5, generator=torch.Generator().manual_seed(0))
    res = ParameterServer(partitions=3).run(gradzip.codec("none"), x, "w", 0, need_own=True)
    assert torch.equal(res.avg, x) and torch.equal(res.own, x) and not res.nonfinite
    comm = gradzip.Communicator("sketchml", collective="ps")
    y = comm.allreduce(x, name="w")
    assert y.shape == x.shape and (y - x).abs().max() <= sketch_bound(x)
    comm.close()


def test_collective_options_reach_the_collective(monkeypatch):
    comm = gradzip.Communicator("maxmin", collective="ps", collective_options={"partitions": 3})
    assert comm.collective.partitions == 3
    comm.close()
    monkeypatch.setenv("GRADZIP_PARTITIONS", "5")
    cfg = gradzip.Config(codec="maxmin", collective="ps").with_env()
    assert cfg.collective_options == {"partitions": 5} and "partitions" not in cfg.options


class _SharedDither(Codec):
    """Test codec (not registered): subtractive dither with noise shared by (seed, step, name).

    Decoding needs the very noise the encoder drew, so a collective that decodes a payload with
    a context whose name differs from the encoder's gets it wrong (and different on each rank).
    """

    name = "_test_shared_dither"
    collectives = ("sra", "allgather")
    options = {"seed": SEED}

    def _noise(self, meta: Meta) -> torch.Tensor:
        return torch.rand(meta.numel, generator=shared_generator(self.seed, meta.step, meta.name))

    def _encode(self, x, meta: Meta):
        return [torch.round(x.float() * 4 + self._noise(meta)).to(torch.int8)]

    def _decode(self, tensors, meta: Meta):
        return (tensors[0].float() - self._noise(meta)) / 4

    def _wire_bytes(self, numel, dtype):
        return numel


def _shared_randomness_sra(rank: int, world: int) -> dict:
    x = (torch.rand(1001, generator=torch.Generator().manual_seed(rank)) - 0.5) * 8
    out = {"x": x}
    for segment in (1 << 22, 100):  # one segment, and eleven pipelined segments
        res = collectives.get("sra")(None, segment=segment).run(_SharedDither(), x, "w", 3, need_own=True)
        out[segment] = {"avg": res.avg, "own": res.own, "wire": res.wire_bytes}
    return out


def test_sra_decodes_with_the_encoders_shared_randomness_also_when_pipelined():
    results = run_workers(_shared_randomness_sra, 3)
    mean = torch.stack([r["x"] for r in results]).mean(0)
    for segment in (1 << 22, 100):
        for r in results:
            rec = r[segment]
            assert rec["avg"].shape == (1001,) and torch.equal(rec["avg"], results[0][segment]["avg"]), segment
            # two dithered quantisations of step 1/4: each off by at most 1/8
            assert (rec["avg"] - mean).abs().max() <= 0.25 + 1e-5, segment
            assert (rec["own"] - r["x"]).abs().max() <= 0.125 + 1e-5, segment  # own first-stage decode
    # eleven segments pad their chunks separately: a few more bytes than one segment
    assert results[0][100]["wire"] >= results[0][1 << 22]["wire"]


@pytest.mark.timeout(60)
def test_a_callback_on_the_worker_may_submit_more_work():
    comm = gradzip.Communicator("none")
    x = torch.ones(10)
    chained = comm.allreduce_async(x, name="a").then(lambda f: comm.allreduce(f.value() * 2, name="b"))
    assert torch.equal(chained.wait(), torch.full((10,), 2.0))
    comm.close()


OUT_CASES = [
    ("maxmin", {}),  # sra: decodes straight into the destination
    ("maxmin", {"collective": "ps"}),
    ("fp16", {}),  # allreduce
    ("powersgd", {}),  # two rounds
    ("topk", {}),  # allgather
    ("maxmin", {"memory": "residual"}),  # stateful memory: an aliasing destination must wait
    # segments: each rank's chunk of a segment averaged straight into the destination
    ("maxmin", {"collective_options": {"segment": 4100}}),
    ("efsignsgd", {}),
]


def _out_worker(rank: int, world: int) -> dict:
    results = {}
    for name, opts in OUT_CASES:
        fresh, into = gradzip.Communicator(name, **opts), gradzip.Communicator(name, **opts)
        try:
            g = torch.Generator().manual_seed(rank)
            same = True
            for step in range(3):
                x = torch.randn(64, 300, generator=g)
                want = fresh.allreduce(x, name="w")
                dest = torch.full_like(x, 7.0)
                got_out = into.allreduce(x.clone(), name="w", out=dest) if step != 1 else None
                if step == 1:  # in place: the input is the destination
                    y = x.clone()
                    got_out = into.allreduce(y, name="w", out=y)
                    same &= got_out.data_ptr() == y.data_ptr()
                else:
                    same &= got_out.data_ptr() == dest.data_ptr()
                same &= torch.equal(got_out, want)
            results[(name, str(opts))] = same
        finally:
            fresh.close()
            into.close()
    return results


def test_allreduce_into_a_destination_matches_a_fresh_result():
    """``out=`` (also the input itself) gives the bits of a fresh result, step after step."""
    for res in run_workers(_out_worker, 2):
        assert all(res.values()), res


def _batch_with_some_outs(rank: int, world: int) -> dict:
    coll, c = collectives.get("allreduce")(None), codec("powersgd", rank=2)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(s, generator=g) for s in [(32, 16), (8,), (24, 40), (16, 16)]]
    names = [f"w{i}" for i in range(len(xs))]
    alone = [coll.run(c, x.clone(), n, 0, need_own=True) for x, n in zip(xs, names)]
    c2 = codec("powersgd", rank=2)
    outs = [torch.full_like(x, 7.0).view(-1) if i % 2 == 0 else None for i, x in enumerate(xs)]
    batch = drive(coll.stages_many(c2, [x.clone() for x in xs], names, 0, True, outs))
    return {
        "avg": all(torch.equal(a.avg, b.avg) for a, b in zip(alone, batch)),
        "own": all(torch.equal(a.own, b.own) for a, b in zip(alone, batch)),
        "into_out": all(b.avg.data_ptr() == o.data_ptr() for b, o in zip(batch, outs) if o is not None),
    }


def test_a_batch_where_some_calls_have_an_out_gives_what_each_call_alone_gives():
    """The all-reduce of a batch (PowerSGD's matrices and a 1-D tensor it sends raw) decodes the
    averages that have an ``out`` there and the others into fresh tensors, and every average
    and own payload has the bits of the tensor exchanged alone, on every rank."""
    for res in run_workers(_batch_with_some_outs, 2):
        assert res == {"avg": True, "own": True, "into_out": True}, res


def test_out_must_match_the_input():
    comm = gradzip.Communicator("maxmin")
    try:
        with pytest.raises(ValueError, match="out must match the input"):
            comm.allreduce(torch.zeros(8), out=torch.zeros(9))
        with pytest.raises(ValueError, match="out must match the input"):
            comm.allreduce(torch.zeros(8), out=torch.zeros(8, dtype=torch.float16))
    finally:
        comm.close()


# ------------------------------------------------------------------ a collective is only its exchange
class _GatherAll(collectives.Collective):
    """A collective written as a user would write one: only its exchange (an all-gather)."""

    name = "gather-all"

    def exchange(self, call):
        from gradzip.codecs.base import Payload
        from gradzip.comm.base import Exchanged, from_bytes, spec_of, to_bytes

        payload = call.encode(call.x)
        call.keep_own(payload)
        gathered = self._all_gather_bytes(to_bytes(payload.tensors, call.flag), call.world_size)
        parts, flags = [], []
        for r in range(call.world_size):
            tensors, flag = from_bytes(gathered[r], spec_of(payload.tensors))
            parts.append(Payload(tensors, payload.ctx))
            flags.append(flag)
        avg = call.decode(call.codec.aggregate, parts).reshape(-1)
        return Exchanged(avg, torch.stack(flags).any(), payload.nbytes)


def _exchange_only(rank: int, world: int) -> dict:
    codec = gradzip.codec("maxmin", bits=4, mode="nearest")  # the same bytes call after call
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(rank))
    mine = _GatherAll(None).run(codec, x, "w", 5, need_own=True)
    theirs = collectives.get("allgather")(None).run(codec, x, "w", 5, need_own=True)
    out = torch.full((x.numel(),), -1.0)
    into = _GatherAll(None).run(codec, x, "w", 5, need_own=False, out=out)
    bad = x.clone()
    bad[0, 0] = float("nan") if rank == 1 else 0.0
    flagged = _GatherAll(None).run(codec, bad, "w", 5, need_own=False)
    return {
        "same_avg": torch.equal(mine.avg, theirs.avg), "same_own": torch.equal(mine.own, theirs.own),
        "own_shape": tuple(mine.own.shape), "timed": mine.encode_s > 0 and mine.decode_s > 0,
        "into_out": into.avg is out and torch.equal(out, mine.avg), "no_own": into.own is None,
        "nonfinite": bool(flagged.nonfinite), "finite": bool(mine.nonfinite),
    }


def test_a_collective_that_implements_only_its_exchange_gets_flag_timer_own_and_out_from_the_base():
    for r in run_workers(_exchange_only, 2):
        assert r["same_avg"] and r["same_own"] and r["own_shape"] == (2100,)
        assert r["timed"] and r["into_out"] and r["no_own"]
        assert r["nonfinite"] and not r["finite"]


class _ForgetsOwn(_GatherAll):
    def exchange(self, call):
        got = super().exchange(call)
        call.own.clear()
        call.keep_own(call.encode(call.flat[:10], "part"))  # only 10 of the values
        return got


def test_an_exchange_that_keeps_own_payloads_for_part_of_the_input_fails_loudly():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="own payloads for 10 of 100 values"):
        _ForgetsOwn(None).run(gradzip.codec("maxmin", bits=4), x, "w", 0, need_own=True)
    assert _ForgetsOwn(None).run(gradzip.codec("maxmin", bits=4), x, "w", 0, need_own=False).own is None


def test_only_a_collective_that_encodes_its_input_whole_carries_parts():
    """A fused buffer's parts go to the codec only through a collective that encodes the input
    in one piece (the all-reduce; the all-gather, which sends such a codec's input whole); one
    that cuts it into chunks refuses them."""
    parts = (("a", torch.Size([4, 4])), ("b", torch.Size([16])))
    assert collectives.get("allreduce").carries_parts and collectives.get("allgather").carries_parts
    for name in ("sra", "ps"):
        coll = collectives.get(name)(None)
        assert not coll.carries_parts
        with pytest.raises(ValueError, match=f"collective {name!r} encodes its input in pieces"):
            drive(coll.stages(codec("fp16"), torch.zeros(32), "g", 0, False, parts=parts))
    res = collectives.get("allreduce")(None).run(codec("powersgd"), torch.ones(32), "g", 0, False)
    assert torch.equal(res.avg, torch.ones(32))  # without parts: one tensor, sent as it is (1-D)
    coll = collectives.get("allreduce")(None)
    x = torch.randn(32, generator=torch.Generator().manual_seed(0))
    fused = drive(coll.stages(codec("powersgd", rank=1), x, "g", 0, False, parts=parts))
    alone = [coll.run(codec("powersgd", rank=1), x[:16].view(4, 4), "a", 0, False), coll.run(codec("powersgd", rank=1), x[16:], "b", 0, False)]
    torch.testing.assert_close(fused.avg, torch.cat([r.avg.reshape(-1) for r in alone]), rtol=1e-6, atol=1e-6)
    # the all-gather hands them over: EF-signSGD's scale a member, each the member's alone
    block = codec("efsignsgd").fused_alignment()
    parts = (("a", torch.Size([7, 9])), ("b", torch.Size([300])))
    x = torch.zeros(2 * block + 256)
    x[:63], x[block : block + 300] = torch.randn(63), torch.randn(300) * 100
    gathered = drive(collectives.get("allgather")(None).stages(codec("efsignsgd"), x, "g", 0, False, parts=parts))
    for a, n in ((0, 63), (block, 300)):
        alone = collectives.get("allgather")(None).run(codec("efsignsgd"), x[a : a + n].clone(), "m", 0, False)
        assert torch.equal(gathered.avg[a : a + n], alone.avg.reshape(-1))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_a_collective_that_lends_its_result_late_says_so_where_its_exchange_is_written():
    """``reads_input_first`` promises what ``exchange`` does (``Call.input_read``, ``out`` through
    ``Call.output``): a subclass that writes its own exchange must not inherit the promise."""
    from gradzip.comm import base, reducescatter  # noqa: F401  (every collective class defined)

    for cls in _subclasses(base.Collective):
        if cls.reads_input_first:
            owner = next(c for c in cls.__mro__ if "exchange" in c.__dict__)
            declared = next(c for c in cls.__mro__ if "reads_input_first" in c.__dict__)
            assert issubclass(declared, owner), (cls.__name__, owner.__name__, declared.__name__)
    assert not reducescatter.CompressedReduceScatter.reads_input_first


def _sra_send_buffers(rank: int, world: int) -> dict:
    """Two SRA calls advanced in turn, as the pipeline does: the first to its all-gather, then
    the second's scatter. What the collective's pool holds after both, by how the first kept
    its own payloads: none kept, kept and settled on release, kept for the end."""
    from gradzip.sync.settle import settle_residual

    held = {}
    for mode in ("none", "settled", "kept"):
        coll = collectives.get("sra")(None)
        c = codec("maxmin", bits=4)
        xs = [torch.randn(4096, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(2)]
        release = settle_residual(torch.zeros(4096)) if mode == "settled" else None
        first = coll.stages(c, xs[0], "a", 0, need_own=mode != "none", on_release=release)
        second = coll.stages(c, xs[1], "b", 0, need_own=False)
        next(first)  # scattered
        next(first)  # reduced, its all-gather issued
        next(second)  # scattered
        for stages in (first, second):
            drive(stages)
        held[mode] = coll._pool.nbytes
    return held


def test_the_sra_gives_its_send_buffer_back_once_its_chunks_arrived():
    """Where nothing reads this rank's own payloads any more (no error feedback, or settled when
    the chunks arrived), the send buffer goes back before the all-gather: the next call's
    scatter takes it, and the pool holds one buffer fewer than where they are kept to the end."""
    for held in run_workers(_sra_send_buffers, 3):
        assert held["none"] == held["settled"] < held["kept"], held


def _sra_settled_in_place(rank: int, world: int) -> dict:
    """An SRA exchange with error feedback settled on release, in one segment and in several,
    averaged over its own input (as a DDP bucket is) and into a result of its own."""
    from gradzip.sync.settle import settle_residual

    out = {}
    for segment in (None, 1200):  # (chunks of whole values: 6000 = 3 x 2000 = 5 x 3 x 400)
        for in_place in (True, False):
            coll = collectives.get("sra")(None, segment=segment)
            spares = []
            lend_values = coll._lend_values
            coll._lend_values = lambda *a, **k: spares.append(a[1]) or lend_values(*a, **k)
            x = torch.randn(6000, generator=torch.Generator().manual_seed(rank))
            residual = torch.zeros(6000)
            res = drive(coll.stages(codec("maxmin", bits=4), x, "a", 0, need_own=True, out=x if in_place else None,
                                    on_release=settle_residual(residual)))
            out[(segment, in_place)] = {"avg": res.avg.clone(), "residual": residual, "spares": spares}
    return out


def test_the_sra_with_error_feedback_averages_its_chunks_in_the_result_once_the_residual_settles():
    """Settled when every rank's flag is known (after the one segment's messages, or the last
    of several), the input is read no more: the chunk this rank averages goes straight into its
    place in the input it overwrites, not into a buffer of the pool; the same values as with a
    result of its own, and every rank gets the same average."""
    results = run_workers(_sra_settled_in_place, 3)
    for segment in (None, 1200):
        for res in results:
            in_place, apart = res[(segment, True)], res[(segment, False)]
            assert in_place["spares"] == [] and len(apart["spares"]) >= 1, (segment, in_place["spares"])
            assert torch.equal(in_place["avg"], apart["avg"]) and torch.equal(in_place["residual"], apart["residual"])
            assert torch.equal(in_place["avg"], results[0][(segment, True)]["avg"])
            assert 0 < float(in_place["residual"].abs().max()) < 1  # 4 bits lose something, not everything


@pytest.mark.parametrize("own_in_input", [False, True])
def test_an_input_made_again_goes_back_once_read_unless_it_holds_this_ranks_own_payload(own_in_input):
    """With error feedback that makes the input again (``LateOut.remade``) the input goes back as
    soon as the exchange has read it, but not while a payload kept as this rank's own lies in
    it (a tensor sent as it is): the residual settles from that payload later."""
    from gradzip.comm.base import Call, LateOut, Timer

    x = torch.randn(64)
    lent = ["input"]  # what the caller lent for the exchange (given back: emptied)
    late = LateOut(lambda: torch.empty(64), lent.clear, remade=True)
    call = Call(codec("maxmin", bits=4), x, "w", 0, True, None, 1, 0, 2, None, Timer(), late=late,
                on_release=lambda call, nonfinite: None)
    own = x if own_in_input else x.clone()
    call.keep_own(Payload([own], None))
    call.input_read()
    assert lent == (["input"] if own_in_input else [])
    call.release_input(torch.tensor(False))  # released: the input goes back now in either case
    assert lent == []


def _variable_into_out(rank: int, world: int) -> dict:
    """Data-dependent payloads through the all-gather: the average into an fp32 ``out`` (with
    the codec's own ``aggregate`` made to fail, so it must be summed there) and into none."""
    out = {}
    for name, options in (("threshold", {"threshold": 1.5}), ("inceptionn", {}), ("dgc", {"ratio": 0.01}),
                          ("graddrop", {})):
        x = torch.randn(30_000, generator=torch.Generator().manual_seed(rank))
        fresh = collectives.get("allgather")(None).run(codec(name, **options), x, "w", 3, need_own=True)
        c = codec(name, **options)  # (a new one draws DGC's and gradient dropping's samples again)
        c.aggregate = None  # (not called where the average goes into out)
        encoded, alive = [], []  # the encoded tensors, and how many live on when the sum starts
        encode, aggregate_into = c.encode, c.aggregate_into

        def recorded(*args, **kwargs):
            payload = encode(*args, **kwargs)
            encoded.extend(weakref.ref(t) for t in payload.tensors)
            return payload

        def summed(payloads, dest, mean=True):
            alive.append(sum(r() is not None for r in encoded))
            return aggregate_into(payloads, dest, mean=mean)

        c.encode, c.aggregate_into = recorded, summed
        into = torch.full_like(x, 7.0)
        res = collectives.get("allgather")(None).run(c, x, "w", 3, need_own=True, out=into)
        out[name] = {"avg_same": torch.equal(res.avg, fresh.avg), "own_same": torch.equal(res.own, fresh.own),
                     "in_out": res.avg.data_ptr() == into.data_ptr(), "freed": bool(encoded) and alive == [0],
                     "avg": res.avg}
    return out


def test_a_data_dependent_payload_is_averaged_into_out():
    """The all-gather of payloads whose size depends on the data sums every rank's straight
    into ``out`` (no average of the input's size made and copied): the same average and own
    payload as into a fresh tensor, the same on every rank; the encoded payload is freed once
    copied into its row of the gathered messages, before the transfer and the sum."""
    results = run_workers(_variable_into_out, 2)
    for name in results[0]:
        flags = [(r[name]["avg_same"], r[name]["own_same"], r[name]["in_out"], r[name]["freed"]) for r in results]
        assert all(all(f) for f in flags), (name, flags)
        assert torch.equal(results[0][name]["avg"], results[1][name]["avg"]), name


def _gathered_rows(rank: int, world: int) -> dict:
    """all_gather_flat over the world and over a group of ranks 0 and 2, synchronous and
    asynchronous, in place and not, with empty rows; and the peak resident memory an
    all-gather of 3 × 4 MB adds (the kernel's high-water mark, reset before it)."""
    from gradzip.bench.memory import _status_kb
    from gradzip.comm.base import all_gather_flat

    pair = dist.new_group([0, 2])
    got = {}
    for label, group, members in (("world", None, [0, 1, 2]), ("pair", pair, [0, 2])):
        if rank not in members:
            continue
        w, me = len(members), members.index(rank)
        for n in (0, 5, 4099):
            out = torch.full((w, n), -1, dtype=torch.int32)
            inp = torch.arange(n, dtype=torch.int32) + 1000 * rank
            all_gather_flat(out.view(-1), inp, group)
            got[label, n, "apart"] = out.tolist()
            out = torch.full((w, n), -1, dtype=torch.int32)
            out[me] = inp
            all_gather_flat(out.view(-1), out[me], group, async_op=True).wait()
            got[label, n, "in place"] = out.tolist()
    out = torch.zeros(3, 4 << 20, dtype=torch.uint8)
    out[rank].fill_(rank + 1)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    all_gather_flat(out.view(-1), out[rank], None)
    got["added"] = (_status_kb("VmHWM") - before) * 1024 / out.numel()
    got["bytes"] = out[:, :: 1 << 20].tolist()
    return got


def test_an_all_gather_on_gloo_fills_the_rows_with_no_temporary_of_their_size():
    """On gloo the rows go by sends and receives straight into the output: every rank holds
    every rank's row in rank order (of the world or of a group, whose ranks are not the
    world's), empty rows included, and the all-gather adds no resident memory of the output's
    size (gloo's own gathers into a temporary of it first)."""
    results = run_workers(_gathered_rows, 3)
    for rank, got in enumerate(results):
        for (label, n, how), rows in ((k, v) for k, v in got.items() if isinstance(k, tuple)):
            members = [0, 1, 2] if label == "world" else [0, 2]
            assert rows == [[1000 * r + i for i in range(n)] for r in members], (rank, label, n, how)
        assert ("pair", 5, "apart") in got or rank == 1
        assert got["bytes"] == [[r + 1] * 4 for r in range(3)]
        assert got["added"] < 0.5, got["added"]


# (codec, collective, values): a 16-bit gradient compensated in fp32 through a collective of two
# rounds, where a form depends on the width (raw below a size, a dense form of its own)
TWO_ROUNDS_16 = [("maxmin", "sra", 7), ("maxmin", "ps", 1), ("maxmin", "sra", 5), ("fp8", "sra", 3),
                 ("u8bit", "sra", 3), ("qsgd", "sra", 3), ("natural", "sra", 3), ("terngrad", "sra", 3),
                 ("sketchml", "sra", 1000), ("sketchml", "ps", 1000), ("maxmin", "ps", 3),
                 ("inceptionn", "ps", 4099), ("maxmin", "sra", 4099)]


def _two_rounds_16(rank: int, world: int) -> list:
    out = []
    for dtype in (torch.float16, torch.bfloat16):
        for name, coll, n in TWO_ROUNDS_16:
            bits = {"bits": 8} if name == "qsgd" else {}  # (QSGD's residual is bounded at 8 bits, not at 4)
            # (TernGrad takes no error feedback: its 16-bit input as it is, through both rounds)
            memory = "none" if name == "terngrad" else "residual"
            comm = gradzip.Communicator(name, memory=memory, collective=coll, **bits)
            for step in range(2):
                x = torch.randn(n, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
                if name == "inceptionn":  # (every value raw: its dense form)
                    x = torch.where(x > 0, 6e4, -6e4).to(dtype)
                mean = torch.stack(_gather(x, world)).float().mean(0)
                avg = comm.allreduce(x, name="w")
                err = float((avg.float() - mean).norm() / mean.norm())
                out.append((name, coll, n, str(dtype), step, err, avg.dtype == dtype, _gather(avg, world)))
            comm.close()
    return out


def test_a_16_bit_gradients_second_round_goes_in_its_width_as_its_first():
    """The scatter-reduce and the parameter server send each chunk's average again: with error
    feedback on a 16-bit gradient, that second round takes the gradient's width as the first
    did, so both have one form and the receivers read it under the first round's context (a
    second round in fp32 was read as raw 16-bit values: averages off by a factor of 100, or a
    size the gloo all-gather aborted on). TernGrad, which takes no error feedback, goes through
    both rounds with its 16-bit input as it is."""
    results = run_workers(_two_rounds_16, 2)
    for row in results[0]:
        name, coll, n, dtype, step, err, same_dtype, everyone = row
        assert err < 0.5 and same_dtype, row[:7]
        assert all(torch.equal(everyone[0], e) for e in everyone), row[:5]
