"""DDP with gradzip on CUDA tensors: over NCCL (one rank, one GPU) and over gloo (two ranks
sharing one GPU). Run on a GPU machine with ``pytest -m gpu``; skipped without CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.frontends.ddp import ACCELERATOR_FUSION_MB, NCCL_NODE_FUSION_MB
from gradzip.kernels import fused

from ..dist_utils import run_workers
from .test_ddp import Net, _batches, _flat_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gathered(model: nn.Module, world: int) -> tuple:
    """The model's parameters (flat, on the CPU) once the device is done, and whether every rank
    holds the same ones (gathered over the default gloo group)."""
    torch.cuda.synchronize()
    flat = _flat_params(model).cpu()
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return flat, all(torch.equal(gathered[0], g) for g in gathered)


def _cuda_job(rank: int, world: int, backend: str, memory: str, in_place: bool, codec: str = "maxmin",
              options: dict | None = None) -> dict:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(world)), backend="nccl") if backend == "nccl" else None
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = DDP(model, device_ids=[0], process_group=group, bucket_cap_mb=0.01)
    if options is None:
        options = {"bits": 4} if codec == "maxmin" else {"rank": 2}
    state = gradzip.register(ddp, codec, memory=memory, min_numel=64, in_place=in_place, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    skipped = 0
    for i, (x, y) in enumerate(_batches(rank, 6)):
        loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        if i == 3 and rank == world - 1:
            loss = loss * float("inf")  # a non-finite step, as an fp16 overflow gives one
        opt.zero_grad()
        loss.backward()
        if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
            skipped += 1
            continue
        opt.step()
    flat, identical = _gathered(model, world)
    stats = state.stats()
    kernels = fused.name(model.fc1.weight.detach(), 4, 1024)
    pipelines, group_mb = state.comm.pipelines(device), state.group_mb()
    residuals_finite = all(bool(torch.isfinite(v).all()) for v in getattr(state.comm.memory, "residuals", {}).values())
    state.close()
    if group is not None:
        dist.destroy_process_group(group)
    return {
        "pipelines": pipelines, "group_mb": group_mb,
        "identical": identical, "finite": bool(torch.isfinite(flat).all()),
        "skipped": skipped, "compressed": stats["params_compressed"] > 0, "kernels": kernels,
        "residuals_finite": residuals_finite,
    }


@pytest.mark.parametrize("in_place", [False, True], ids=["fused", "in-place"])
@pytest.mark.parametrize("memory", ["none", "residual"])
def test_ddp_over_nccl_on_one_gpu(memory, in_place):
    (res,) = run_workers(_cuda_job, 1, "nccl", memory, in_place)
    # NCCL queues its collectives on the stream: each job runs through, in groups of one node's size
    assert res["pipelines"] is False and res["group_mb"] == NCCL_NODE_FUSION_MB
    del res["pipelines"], res["group_mb"]
    assert res == {"identical": True, "finite": True, "skipped": 1, "compressed": True, "kernels": res["kernels"],
                   "residuals_finite": True}
    assert res["kernels"] in ("triton", "torch")


def test_powersgd_over_nccl_on_one_gpu():
    """PowerSGD's batched orthonormalisation and its flag from the packed factors, on CUDA."""
    (res,) = run_workers(_cuda_job, 1, "nccl", "residual", False, "powersgd")
    assert res["identical"] and res["finite"] and res["compressed"] and res["residuals_finite"], res
    assert res["skipped"] == 1


@pytest.mark.parametrize("codec,memory,opts", [
    ("efsignsgd", "efsign", {}), ("onebit", "residual", {}), ("terngrad", "none", {}), ("natural", "none", {}),
    ("signum", "none", {}), ("topk", "residual", {}), ("randomk", "residual", {}), ("graddrop", "residual", {}),
    ("dgc", "dgc", {}), ("adaq", "residual", {}), ("threshold", "residual", {}), ("inceptionn", "residual", {}),
    ("cl_tbq", "residual", {}), ("sketchml", "none", {}), ("sketchml", "residual", {"ratio": 0.05}),
    ("cl_onebit", "residual", {})])
def test_codecs_that_take_a_group_by_its_parts_on_cuda(codec, memory, opts):
    """The codecs that take a fused group by its parts (EF-signSGD, 1-bit SGD, TernGrad, natural
    compression, Signum, top-k, random-k, gradient dropping, DGC with its memory, AdaComp,
    SketchML dense and sparse, a CompLL codec that reduces through its context) or
    fused later (threshold, INCEPTIONN, a CompLL codec with a block) on CUDA: one call a group;
    over NCCL on one GPU and over gloo on two ranks sharing it, a non-finite step skipped
    everywhere, replicas identical."""
    for world, backend in ((1, "nccl"), (2, "gloo")):
        for res in run_workers(_cuda_job, world, backend, memory, False, codec, opts):
            assert res["identical"] and res["finite"] and res["compressed"] and res["residuals_finite"], res
            assert res["skipped"] == 1, res


@pytest.mark.parametrize("in_place", [False, True], ids=["fused", "in-place"])
@pytest.mark.parametrize("memory", ["none", "residual"])
def test_ddp_over_gloo_with_cuda_tensors_on_two_ranks_sharing_a_gpu(memory, in_place):
    for res in run_workers(_cuda_job, 2, "gloo", memory, in_place):
        assert res["pipelines"] is True and res["group_mb"] == ACCELERATOR_FUSION_MB  # gloo blocks the worker
        assert res["identical"] and res["finite"] and res["compressed"] and res["residuals_finite"], res
        assert res["skipped"] == 1  # every rank skips the step one rank overflowed


def _held_on_cuda(rank: int, world: int) -> dict:
    """Buckets that complete no group hold their biases for a later job, on CUDA tensors over
    gloo: the biases' averages are DDP's own, bit for bit, once the step ends (the held futures
    are completed on the worker's side stream, as the groups' are)."""
    from .test_ddp import Tower

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    grads = []
    for hook in (False, True):
        torch.manual_seed(0)
        model = Tower().to(device)
        ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.015)
        state = gradzip.register(ddp, "maxmin", bits=4, min_numel=64, fusion_mb=0.05) if hook else None
        per_step = []
        for x, _ in _batches(rank, 3):
            ddp.zero_grad()
            ddp(x.repeat(1, 2).to(device)).square().mean().backward()
            per_step.append({n: p.grad.cpu() for n, p in model.named_parameters() if n.endswith("bias")})
        grads.append(per_step)
        if state is not None:
            state.close()
    return {"equal": all(torch.equal(a[n], b[n]) for a, b in zip(*grads) for n in a)}


def test_held_plain_gradients_on_cuda_tensors_are_ddps_averages():
    for res in run_workers(_held_on_cuda, 2):
        assert res["equal"]


def _uses_the_gpu(rank: int, world: int) -> dict:
    bad_fork = torch.cuda._is_in_bad_fork()  # (set where the process it was forked from had started CUDA)
    return {"bad_fork": bad_fork, "sum": torch.ones(4, device="cuda").sum().item()}


def test_ranks_forked_from_the_server_start_cuda_themselves():
    """The fork server imports torch and what DDP's constructor imports, never CUDA: each rank
    forked from it starts CUDA on its own."""
    from gradzip.comm.launch import spawn_local

    for res in spawn_local(_uses_the_gpu, 2, all_ranks=True):
        assert res == {"bad_fork": False, "sum": 4.0}


def _every_codec_on_cuda(rank: int, world: int) -> dict:
    """Every codec with its default memory on CUDA tensors, its gradients fused into groups and
    each alone (``fusion=False``): the device's kernels, lone-tensor paths (a sparsifier's
    threshold, a quantiser's tail bucket) and encodes into the collective's message."""
    from .test_ddp import CODEC_OPTS

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = {}
    for name in gradzip.codecs.names():
        for fusion in (True, False):
            torch.manual_seed(0)
            model = Net().to(device)
            start = _flat_params(model).cpu()
            ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)
            state = gradzip.register(ddp, name, min_numel=64, fusion=fusion, **CODEC_OPTS.get(name, {}))
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            for x, y in _batches(rank, 6):
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
                opt.step()
            flat, identical = _gathered(model, world)
            stats = state.stats()
            state.close()
            out[f"{name}-{'fused' if fusion else 'alone'}"] = {
                "identical": identical, "finite": bool(torch.isfinite(flat).all()),
                "moved": not torch.equal(start, flat), "compressed": stats["tensors_compressed"],
            }
    return out


def test_every_codec_on_cuda_tensors_keeps_replicas_identical():
    """Two ranks sharing the GPU over gloo: every codec, fused and alone, trains (finite, moved),
    compresses the three weight matrices and leaves every rank with the same parameters."""
    for res in run_workers(_every_codec_on_cuda, 2):
        assert len(res) == 2 * len(gradzip.codecs.names())
        for key, rec in res.items():
            expected = 0 if key.startswith("none-") else 3  # none sends them as they are: DDP's own sum
            assert rec == {"identical": True, "finite": True, "moved": True, "compressed": expected}, (key, rec)



def _side_stream_writes_seen(rank: int, world: int) -> dict:
    """What the caller's stream reads of a buffer that a job writes on the worker's side stream
    after holding it for a while, through the futures the DDP hook combines (a job returning
    None, a CPU future completed last, every input complete before they are combined) and
    after ``flush``."""
    from gradzip.frontends.ddp import _all_of

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    comm = gradzip.Communicator("maxmin", bits=4)
    out = {}

    def write(buf: torch.Tensor, value: float):
        def job() -> None:
            torch.cuda._sleep(50_000_000)  # the side stream busy for tens of ms; the host goes on
            buf.fill_(value)
        return job

    for case in ("none last", "cpu future last", "complete before", "flush"):
        buf = torch.zeros(1 << 20, device=device)
        torch.cuda.synchronize()
        futures = [comm.submit(write(buf, 1.0), device)]
        if case == "flush":
            comm.flush()
            seen = buf.clone()
        else:
            if case == "none last":
                futures.append(comm.submit(lambda: None, device))
            elif case == "cpu future last":
                late = torch.futures.Future()
                futures.append(late)
                comm.submit(lambda: late.set_result(None), device)
            else:
                futures.append(comm.submit(lambda: None, device))
                for f in futures:
                    f.wait()  # done on the host; the side stream still sleeps
            seen = _all_of(futures, buf, comm).wait().clone()
        torch.cuda.synchronize()
        out[case] = bool(seen.eq(1.0).all())
    comm.close()
    return out


def test_combined_futures_order_the_caller_after_the_side_streams_writes():
    """The future the hook gives DDP for a bucket that waits on several jobs orders its waiter
    after every write the worker queued on its side stream, whatever the last of them to
    complete holds (PyTorch records a future's CUDA events only for the tensors its value
    holds) and where all were complete before being combined; so does ``flush``."""
    (res,) = run_workers(_side_stream_writes_seen, 1)
    assert res == {"none last": True, "cpu future last": True, "complete before": True, "flush": True}


def _held_side_stream(rank: int, world: int, backend: str, hold: bool) -> dict:
    """Six steps of the ``find_unused_parameters`` model with error feedback (its branch unused
    on some ranks at some steps: the bucket that holds it waits last for a job that puts its
    memory back and returns nothing); with ``hold``, every job first keeps the worker's side
    stream busy for a while, so that its writes land long after the host has moved on."""
    from .test_ddp import _Sometimes

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(world)), backend="nccl") if backend == "nccl" else None
    torch.manual_seed(0)
    net = _Sometimes().to(device)
    net.rank = rank
    ddp = DDP(net, device_ids=[0], process_group=group, find_unused_parameters=True, bucket_cap_mb=0.01)
    state = gradzip.register(ddp, "maxmin", bits=4, memory="residual", min_numel=64)
    if hold:
        stages = state.comm.batch_stages

        def held(batch, step):
            torch.cuda._sleep(20_000_000)  # about 10 ms of the side stream, none of the host's
            return (yield from stages(batch, step))

        state.comm.batch_stages = held
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step, (x, y) in enumerate(_batches(rank, 6)):
        net.step = step
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        opt.step()
    flat, identical = _gathered(net, world)
    # (the last weight in a group of its own: its bucket does not wait for the branch's job)
    groups = [list(g) for g in state.fusion_plan.groups]
    state.close()
    if group is not None:
        dist.destroy_process_group(group)
    return {"params": flat, "identical": identical, "groups": groups}


def test_ddp_reads_a_bucket_after_the_side_streams_writes():
    """DDP reads each bucket on its own stream once the hook's future allows: that must come
    after every write the worker queued on its side stream, also where the last job the bucket
    waits for returns nothing (an unused parameter's memory put back). Holding the side stream
    back changes only timing, so the parameters are those of the run without the hold, bit
    for bit."""
    for world, backend in ((1, "nccl"), (2, "gloo")):
        free = run_workers(_held_side_stream, world, backend, False)
        held = run_workers(_held_side_stream, world, backend, True)
        for a, b in zip(free, held):
            assert ["b.weight"] in a["groups"], a["groups"]
            assert a["identical"] and b["identical"]
            assert torch.equal(a["params"], b["params"]), (world, float((a["params"] - b["params"]).abs().max()))
