"""Metrics: one compression ratio whatever the world size, counts per parameter and per step,
the readable summary, the writers (TensorBoard, CSV, logging) and the registration log."""
from __future__ import annotations

import csv
import io
import logging
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.comm.base import measure_cpu_time
from gradzip.config import Config
from gradzip.frontends.ddp import GradzipState
from gradzip.comm.base import traffic_factor
from gradzip.sync.metrics import CSVLogger, Metrics

from ..dist_utils import run_workers

# one per collective: sra (maxmin), ps, allgather (topk), allreduce in two rounds (powersgd)
CONFIGS = {
    "maxmin": dict(codec="maxmin", bits=4),
    "maxmin-ps": dict(codec="maxmin", bits=4, collective="ps"),
    "topk": dict(codec="topk", ratio=0.05),
    "powersgd": dict(codec="powersgd", rank=2),
}
STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # 16384-value weights: their chunks (sra) and partitions (ps) at 2 and 4 ranks are whole
        # max-min buckets; the last layer's weight (640 values) is under min_numel
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _expected_wire(codec: gradzip.codecs.base.Codec, model: nn.Module, state, min_numel: int = 1024) -> tuple:
    """(raw, wire) bytes of one step by the definition: one encoding of each compressed gradient,
    or, for a bucket averaged in its own memory, one encoding of the whole bucket (its
    uncompressed gradients' places travel as zeros, their values in the plain sum)."""
    raw = wire = 0
    in_place = {n for _, names in state.in_place_buckets.values() for n in names}
    for name, p in model.named_parameters():
        raw += p.numel() * 4
        compressed = p.numel() >= min_numel and p.dim() > 1
        if compressed and name in in_place:
            continue
        wire += codec.wire_bytes(p.numel(), p.dtype, shape=tuple(p.shape)) if compressed else p.numel() * 4
    for numel, _ in state.in_place_buckets.values():
        wire += codec.wire_bytes(numel, torch.float32)
    return raw, wire


def _run(rank: int, world: int, tmp: str) -> dict:
    handler = _Capture()
    log = logging.getLogger("gradzip")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    out = _train_all(rank, None, tmp, handler)
    if world == 2:
        # the script says bits=4, the environment bits=2: the environment wins, with one warning
        os.environ["GRADZIP_BITS"] = "2"
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                state = gradzip.register(DDP(Net()), "maxmin", bits=4, min_numel=4096)
            out["override"] = {
                "bits": state.comm.codec.bits,
                "warnings": [str(w.message) for w in caught if "GRADZIP" in str(w.message)],
            }
            state.close()
        finally:
            del os.environ["GRADZIP_BITS"]
    out["log"] = handler.records
    log.removeHandler(handler)
    return out


def _train_all(rank: int, group, tmp: str, handler: "_Capture") -> dict:
    out = {}
    world = dist.get_world_size(group)
    for label, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model, bucket_cap_mb=0.03, process_group=group)  # several buckets, rebuilt after step 1
        opts = dict(cfg)
        state = gradzip.register(ddp, opts.pop("codec"), memory="residual" if label == "maxmin" else None, **opts)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for i in range(STEPS + 1):  # the first step, before DDP rebuilds its buckets, is not counted
            if i == 1:
                state.comm.metrics.reset()
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        stats = state.stats(per_tensor=True)
        out[label] = {"stats": stats, "expected": _expected_wire(state.comm.codec, model, state)}
        if label == "maxmin" and rank == 0:
            out["summary"] = state.summary(per_layer=True)
            path = os.path.join(tmp, f"metrics-{world}.csv")
            state.log_to(path, step=1)
            state.log_to(path)  # a second row under the same header
            with open(path, newline="") as f:
                out["csv"] = list(csv.reader(f))
            state.log_to()  # to the "gradzip" logger
            out["log_line"] = handler.records[-1]
        state.close()
    return out


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("metrics"))
    return {world: run_workers(_run, world, tmp) for world in (2, 4)}


def test_the_ratio_is_the_same_at_2_and_4_ranks_and_follows_its_definition(runs):
    for label in CONFIGS:
        ratios = {}
        for world, results in runs.items():
            for rank, res in enumerate(results):
                s = res[label]["stats"]
                raw, wire = res[label]["expected"]
                assert s["world_size"] == world
                # raw_bytes: the gradients' size; wire_bytes: one encoding of each gradient
                assert s["raw_bytes"] == STEPS * raw, (label, world)
                if label != "topk":  # top-k's wire_bytes() is an upper bound (k values, fewer if zero)
                    assert s["wire_bytes"] == STEPS * wire, (label, world, rank, s["wire_bytes"], STEPS * wire)
                assert s["ratio"] == round(s["raw_bytes"] / s["wire_bytes"], 2)
                # what a rank sends: f(W) times its compressed bytes, f of the parameter's collective
                sent = sum(
                    traffic_factor(s["collective"] if row["compressed"] else "allreduce", world) * row["wire_bytes"]
                    for row in s["per_tensor"].values()
                )
                assert s["sent_bytes"] == pytest.approx(sent, abs=8), (label, world)
                ratios.setdefault(world, set()).add(s["ratio"])
        assert ratios[2] == ratios[4] and len(ratios[2]) == 1, f"{label}: ratio moves with the world size: {ratios}"
    # the ratio means something: max-min 4-bit is about 8x on its tensors
    maxmin = runs[4][0]["maxmin"]["stats"]
    # alone it would be 4 * 16384 / 8320 = 7.88x; averaged in its bucket's memory it shares the
    # bucket's encoding, whose uncompressed places travel as zeros
    assert 7.0 < maxmin["per_tensor"]["fc1.weight"]["ratio"] <= round(4 * 16384 / 8320, 2) == 7.88
    assert 6.0 < maxmin["ratio"] < 7.0 and maxmin["collective"] == "sra"  # with the uncompressed ones
    assert runs[4][0]["powersgd"]["stats"]["collective"] == "allreduce"
    # the traffic does grow with W: 2(W-1)/W is 1 at two ranks and 1.5 at four
    assert runs[4][0]["maxmin"]["stats"]["sent_bytes"] == pytest.approx(1.5 * runs[2][0]["maxmin"]["stats"]["sent_bytes"], rel=1e-6)


def test_counts_are_per_parameter_and_steps_per_step(runs):
    names = {n for n, _ in Net().named_parameters()}
    for world, results in runs.items():
        for res in results:
            s = res["maxmin"]["stats"]
            assert s["steps"] == STEPS
            # the fused uncompressed all-reduce is recorded per parameter, so DDP's bucket rebuild
            # after the first step changes nothing: every parameter, once per step
            assert set(s["per_tensor"]) == names
            assert all(row["calls"] == STEPS for row in s["per_tensor"].values())
            assert (s["params_compressed"], s["params_uncompressed"]) == (2, 4)
            assert s["tensors_compressed"] == 2 and s["tensors_uncompressed"] == 4
            assert {n for n, row in s["per_tensor"].items() if row["compressed"]} == {"fc1.weight", "fc2.weight"}
            assert sum(row["wire_bytes"] for row in s["per_tensor"].values()) == s["wire_bytes"]
            # CPU time is not measured by default, so it is not reported
            assert "encode_cpu_s" not in s and "calls" not in s
            # rounded: no 15-digit floats
            assert s["encode_s"] == round(s["encode_s"], 4) and s["ratio"] == round(s["ratio"], 2)


def test_summary_csv_and_log_line(runs):
    res = runs[4][0]
    summary = res["summary"]
    assert "rank 0 of 4, 3 steps" in summary
    lines = summary.splitlines()
    header = next(line for line in lines if line.startswith("codec"))
    assert header.split()[:3] == ["codec", "params", "raw"]
    maxmin_row = next(line for line in lines if line.startswith("maxmin "))
    total_row = next(line for line in lines if line.startswith("total "))
    assert maxmin_row.split()[1] == "2" and total_row.split()[1] == "6"
    assert total_row.split()[5] == f"{res['maxmin']['stats']['ratio']:.2f}x"
    layer = next(line for line in lines if line.startswith("fc1.weight"))
    assert layer.split()[4] == "yes" and next(line for line in lines if line.startswith("fc3.weight")).split()[4] == "no"
    rows = res["csv"]
    assert rows[0][0] == "step" and "ratio" in rows[0] and "wire_bytes" in rows[0]
    assert [r[0] for r in rows[1:]] == ["1", str(STEPS)]
    assert float(rows[1][rows[0].index("ratio")]) == res["maxmin"]["stats"]["ratio"]
    assert res["log_line"].startswith(f"gradzip step {STEPS}: ratio {res['maxmin']['stats']['ratio']:.2f}x")


def test_registration_logs_the_settings_and_their_sources_and_warns_on_a_conflicting_variable(runs):
    rank0, rank1 = runs[2]
    report = next(m for m in rank0["log"] if "effective settings" in m)
    rows = {line.split()[0]: line for line in report.splitlines()[1:]}
    assert rows["codec"].split()[1:] == ["'maxmin'", "argument"]
    assert rows["codec.bits"].split()[1:] == ["4", "argument"]
    assert rows["codec.bucket_size"].split()[1:] == ["1024", "default"]
    assert rows["memory"].split()[1:] == ["'residual'", "argument"]
    assert rows["min_numel"].split()[1:] == ["1024", "default"]
    assert not any("effective settings" in m for m in rank1["log"]), "only rank 0 logs the settings"
    override = next(m for m in reversed(rank0["log"]) if "effective settings" in m)
    assert "codec.bits" in override and "environment GRADZIP_BITS=2" in override
    assert "min_numel" in override and [ln for ln in override.splitlines() if ln.startswith("min_numel")][0].split()[2] == "argument"
    for res in runs[2]:
        assert res["override"]["bits"] == 2
        assert res["override"]["warnings"] == ["GRADZIP_BITS=2 overrides bits=4 set by the script"]


# ------------------------------------------------------------------ single process
def _state(**kw) -> GradzipState:
    comm = gradzip.Communicator("maxmin", bits=4, **kw)
    return GradzipState(comm, {}, Config())


def _steps(state: GradzipState, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(64, 64, generator=g), torch.randn(64, generator=g), torch.randn(8, 8, generator=g)]
    names = ["a.weight", "a.bias", "b.weight"]
    for _ in range(steps):
        state.comm.reduce_many_now(tensors, names, [state.should_compress(t) for t in tensors])


def test_metrics_share_a_fused_group_out_per_parameter():
    m = Metrics()
    m.record_group([("x", 300), ("y", 100)], wire=401, encode_s=0.004, decode_s=0.002, sent=802.0)
    s = m.summary(per_tensor=True)
    assert s["per_tensor"]["x"]["wire_bytes"] + s["per_tensor"]["y"]["wire_bytes"] == 401
    assert s["per_tensor"]["x"]["encode_ms"] == 3.0 and s["per_tensor"]["y"]["decode_ms"] == 0.5
    assert s["sent_bytes"] == 802 and s["params_uncompressed"] == 2 and s["steps"] == 1


def test_a_groups_calls_are_summed_and_shared_out_only_when_read():
    m = Metrics()
    members = (("a", 400), ("b", 100), ("c", 100))
    for step in range(7):
        m.record_group(members, wire=101 + step, encode_s=0.006, decode_s=0.003, compressed=True, codec="maxmin")
    assert not m._tensors  # nothing per parameter while the comm thread records
    s = m.summary(per_tensor=True)
    rows = s["per_tensor"]
    assert [rows[n]["calls"] for n in "abc"] == [7, 7, 7] and s["steps"] == 7
    assert [rows[n]["raw_bytes"] for n in "abc"] == [2800, 700, 700]
    assert sum(rows[n]["wire_bytes"] for n in "abc") == sum(101 + k for k in range(7))  # exact, in whole bytes
    assert abs(rows["a"]["wire_bytes"] - 4 * rows["b"]["wire_bytes"]) <= 4
    assert rows["a"]["encode_ms"] == pytest.approx(7 * 4.0) and rows["c"]["decode_ms"] == pytest.approx(7 * 0.5)
    assert s["params_compressed"] == 3
    # more calls after a read add to what was shared out
    m.record_group(list(members), wire=60, encode_s=0.0, decode_s=0.0, compressed=True, codec="maxmin")
    assert m.summary(per_tensor=True)["per_tensor"]["a"]["calls"] == 8
    # many small members: whole bytes, none negative, the group's total exactly
    many = Metrics()
    many.record_group([(f"p{i}", 8) for i in range(60)], wire=100, encode_s=0.0, decode_s=0.0)
    wires = [r["wire_bytes"] for r in many.summary(per_tensor=True)["per_tensor"].values()]
    assert sum(wires) == 100 and min(wires) >= 1 and max(wires) <= 2, wires


def test_a_parameters_codec_is_that_of_its_latest_call_grouped_or_alone():
    m = Metrics()
    m.record_group([("w", 40), ("v", 40)], wire=80, encode_s=0.0, decode_s=0.0, compressed=False, codec="none")
    m.record("w", 40, 5, 0.0, 0.0, compressed=True, codec="maxmin")  # after the warm-up, alone
    m.record_group([("v", 40), ("u", 40)], wire=10, encode_s=0.0, decode_s=0.0, compressed=True, codec="maxmin")
    stats = m.tensors
    assert (stats["w"].compressed, stats["w"].codec) == (True, "maxmin")
    assert (stats["v"].compressed, stats["v"].codec) == (True, "maxmin") and stats["v"].calls == 2
    m.record_group([("w", 40), ("v", 40)], wire=80, encode_s=0.0, decode_s=0.0, compressed=False, codec="none")
    assert not m.tensors["w"].compressed and m.tensors["u"].compressed
    m.reset()
    assert m.summary()["steps"] == 0 and not m.tensors


def test_reading_while_the_worker_records_loses_no_call():
    import threading

    m = Metrics()
    members = tuple((f"p{i}", 8) for i in range(50))
    done = threading.Event()

    def worker() -> None:
        for _ in range(3000):
            m.record_group(members, wire=10, encode_s=0.0, decode_s=0.0, compressed=True)
            m.record("alone", 8, 3, 0.0, 0.0)
        done.set()

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns between almost any two bytecodes
    try:
        t = threading.Thread(target=worker)
        t.start()
        while not done.is_set():
            m.summary()
        t.join()
    finally:
        sys.setswitchinterval(interval)
    s = m.summary(per_tensor=True)
    assert s["wire_bytes"] == 3000 * 13 and s["per_tensor"]["p7"]["calls"] == 3000 and s["steps"] == 3000


def test_traffic_factor_per_collective():
    assert traffic_factor("allreduce", 4) == traffic_factor("sra", 4) == traffic_factor("ps", 4) == 1.5
    assert traffic_factor("allgather", 4) == 3.0
    assert traffic_factor("allreduce", 1) == traffic_factor("allgather", 1) == 0.0


def test_cpu_time_is_reported_only_where_measured():
    state = _state()
    _steps(state)
    assert "encode_cpu_s" not in state.stats()
    measure_cpu_time(True)
    try:
        state.comm.metrics.reset()
        _steps(state, 8)
    finally:
        measure_cpu_time(False)
    s = state.stats()
    # a thread's CPU clock may advance in scheduler ticks on a loaded machine: one short
    # section can read 0, the work of eight steps cannot
    assert s["encode_cpu_s"] >= 0 and s["decode_cpu_s"] >= 0 and s["encode_cpu_s"] + s["decode_cpu_s"] > 0
    state.close()


def test_log_to_writes_add_scalar_writers_csv_writers_csv_files_and_the_logger(tmp_path, caplog):
    state = _state()
    _steps(state, 3)

    class Scalars:  # anything with add_scalar is a writer
        def __init__(self):
            self.rows = []

        def add_scalar(self, tag, value, global_step):
            self.rows.append((tag, value, global_step))

    sink = Scalars()
    values = state.log_to(sink, step=7)
    assert ("gradzip/ratio", state.stats()["ratio"], 7) in sink.rows
    assert {t for t, _, _ in sink.rows} == {f"gradzip/{k}" for k in values}
    assert all(isinstance(v, float) for _, v, _ in sink.rows)

    text = io.StringIO()
    w = csv.writer(text)
    state.log_to(w, step=1)
    state.log_to(w, step=2)
    rows = list(csv.reader(io.StringIO(text.getvalue())))
    assert rows[0][:2] == ["step", "world_size"] and [r[0] for r in rows[1:]] == ["1", "2"]

    path = tmp_path / "m.csv"
    logger = CSVLogger(path)
    state.log_to(logger, step=1)
    state.log_to(CSVLogger(path), step=2)  # appends to the file under its existing header
    rows = list(csv.reader(open(path, newline="")))
    assert len(rows) == 3 and rows[0][0] == "step" and rows[2][0] == "2"
    assert float(rows[2][rows[0].index("raw_bytes")]) == state.stats()["raw_bytes"]

    with caplog.at_level(logging.INFO, logger="gradzip"):
        state.log_to()
    assert caplog.records[-1].name == "gradzip" and caplog.records[-1].getMessage().startswith("gradzip step 3: ratio")
    with pytest.raises(TypeError, match="add_scalar"):
        state.log_to(42)
    state.close()


def test_log_to_a_tensorboard_summary_writer(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    state = _state()
    _steps(state, 2)
    writer = SummaryWriter(log_dir=str(tmp_path))
    state.log_to(writer, step=5)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    ratio = events.Scalars("gradzip/ratio")
    assert [(e.step, round(e.value, 2)) for e in ratio] == [(5, state.stats()["ratio"])]
    assert "gradzip/wire_bytes" in events.Tags()["scalars"]
    state.close()


def test_summary_table_lists_codecs_and_layers():
    state = _state()
    _steps(state, 2)
    text = state.summary(per_layer=True)
    assert "rank 0 of 1, 2 steps" in text
    for name in ("a.weight", "a.bias", "b.weight", "uncompressed", "maxmin", "total"):
        assert any(line.startswith(name + " ") for line in text.splitlines()), name
    assert "a.weight" not in state.summary()
    state.close()


def test_an_environment_variable_that_overrides_a_script_value_warns_once_naming_both():
    with pytest.warns(UserWarning, match=r"^GRADZIP_BITS=2 overrides bits=4 set by the script$") as caught:
        out = Config(codec="maxmin", options={"bits": 4}).with_env({"GRADZIP_BITS": "2"})
    assert out.options == {"bits": 2} and len(caught) == 1
    with pytest.warns(UserWarning, match=r"GRADZIP_MEMORY=none overrides memory='residual'"):
        Config(memory="residual").with_env({"GRADZIP_MEMORY": "none"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same value, or a setting the script left alone: nothing said
        Config(codec="maxmin", options={"bits": 4}).with_env({"GRADZIP_BITS": "4", "GRADZIP_BUCKET_SIZE": "512"})
    cfg = Config(codec="maxmin", options={"bits": 4}, given={"codec": "argument"}).with_env({"GRADZIP_MIN_NUMEL": "10"})
    assert cfg.origin("codec") == "argument" and cfg.origin("codec.bits") == "config"
    assert cfg.origin("min_numel") == "environment GRADZIP_MIN_NUMEL=10" and cfg.origin("compress_1d") == "default"
