"""Smoke tests of the ``gradzip`` command: the demo and the benchmarks.

They run the real thing (spawned gloo ranks) at tiny settings, through ``gradzip.tools.cli.main``.
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
import torch

from gradzip.tools import cli, demo
from gradzip.bench import cluster
from gradzip.bench.micro import codec_limit

from ..dist_utils import completed

pytest.importorskip("sklearn")
pytest.importorskip("rich")
pytest.importorskip("matplotlib")


@pytest.mark.timeout(120)
def test_demo_without_a_cluster_says_so_first_and_estimates_the_wire(tmp_path, capsys, monkeypatch):
    # the default --rate asks for the emulated cluster; here it is unavailable, so the demo runs
    # on loopback and must say, before anything else, that loopback cannot show a gain
    monkeypatch.setattr(cluster, "available", lambda: "network namespaces and tc need root")
    out = tmp_path / "demo"
    rc = cli.main([
        "demo", "--workers", "2", "--epochs", "1", "--width", "64", "--batch-size", "64",
        "--configs", "fp32,maxmin4", "--out", str(out),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    first = printed.splitlines()[:4]
    assert "loopback (no emulated cluster: network namespaces and tc need root)" in first[0]
    assert "cannot show a gain" in first[1]
    assert "100 Mbit/s link" in first[2] and "2(W−1)/W" in first[2]  # the formula of the estimate
    report = json.loads((out / "results.json").read_text())
    assert report["emulated"] is False and report["link_rate"] == "100mbit"
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["fp32", "maxmin4"]
    for r in rows.values():
        assert isinstance(r["test_accuracy"], float) and r["test_accuracy"] > 10.0  # better than chance
        assert r["identical"] is True
        assert r["wire_bytes"] > 0 and len(r["loss_per_step"]) == r["steps"] > 0
        # two ranks: a ring all-reduce and SRA both send 2(W−1)/W = 1 payload per rank and step
        assert r["link_s"] == pytest.approx(r["wire_bytes"] * 8 / 1e8)
    assert rows["maxmin4"]["wire_bytes"] < rows["fp32"]["wire_bytes"]
    assert report["headline"][0].startswith("maxmin 4-bit: ") and "fewer bytes than fp32" in report["headline"][0]
    assert report["headline"][0] in printed and "wire s" in printed
    assert printed.index(report["headline"][0]) < printed.index("identical")  # the headline before the table
    assert _is_png(out / "demo.png")



@pytest.mark.timeout(120)
def test_demo_on_two_nodes_times_the_wire_by_what_crosses_nodes(tmp_path, capsys):
    """With nodes of two ranks gradzip exchanges hierarchically: the wire time is that of the
    bytes on a node's link (its ranks' compressed shares sent across nodes, and the flat ring of
    the uncompressed gradients), less than the flat estimate."""
    out = tmp_path / "demo"
    rc = cli.main([
        "demo", "--workers", "4", "--ranks-per-node", "2", "--rate", "loopback", "--epochs", "1", "--width", "64",
        "--batch-size", "64", "--configs", "fp32,maxmin4", "--out", str(out),
    ])
    assert rc == 0
    rows = {r["config"]: r for r in json.loads((out / "results.json").read_text())["results"]}
    fp32, mm = rows["fp32"], rows["maxmin4"]
    assert fp32["node_link_bytes"] is None and fp32["link_s"] == pytest.approx(1.5 * fp32["wire_bytes"] * 8 / 1e8)
    assert 0 < mm["node_link_bytes"] < 1.5 * mm["wire_bytes"]
    assert mm["link_s"] == pytest.approx(mm["node_link_bytes"] * 8 / 1e8)
    assert mm["link_s"] < demo.link_seconds(mm["wire_bytes"], mm["collective"], 4, "100mbit")
    assert "hierarchical: the bytes on the node's link" in " ".join(capsys.readouterr().out.split())  # (wrapped)


def _demo_report(fp32_s, maxmin_s, emulated=True, acc=(97.2, 96.9)):
    row = lambda name, wall, acc, wire: {  # noqa: E731
        "config": name, "wall_s": wall, "test_accuracy": acc, "wire_bytes": wire, "steps": 178,
        "link_s": 1.5 * wire * 8 / 1e9,
    }
    return {
        "emulated": emulated, "link_rate": "1gbit", "cores": 2, "options": {"workers": 4},
        "results": [row("fp32", fp32_s, acc[0], 1.5e9), row("torch-fp16", fp32_s / 2, acc[0], 0.75e9),
                    row("maxmin4", maxmin_s, acc[1], 0.2e9)],
    }


def test_demo_headline_is_computed_from_the_run():
    win = demo.headline(_demo_report(30.0, 10.0))
    assert win[0] == "maxmin 4-bit: 3.0× faster than fp32 at 1 Gbit/s, same accuracy (96.9% vs 97.2%)."
    assert "7.5× fewer bytes" in win[1] and "1.5× faster than PyTorch's fp16 hook" in win[1]
    worse = demo.headline(_demo_report(30.0, 10.0, acc=(97.2, 90.0)))
    assert "same accuracy" not in worse[0] and "accuracy (90.0% vs 97.2%)" in worse[0]
    lost = demo.headline(_demo_report(10.0, 12.0))  # no false claim when the run shows no gain
    assert lost[0].startswith("maxmin 4-bit: no gain in this run at 1 Gbit/s") and "faster" not in lost[0]
    loop = demo.headline(_demo_report(3.0, 9.0, emulated=False))
    assert "7.5× fewer bytes than fp32" in loop[0] and "2.4 s of wire time against fp32's 18 s" in loop[0]
    assert "took 9.0 s against fp32's 3.0 s" in loop[1]
    assert demo.link_seconds(1e9, "allgather", 4, "1gbit") == pytest.approx(24.0)  # W−1 payloads
    assert demo.link_seconds(1e9, "sra", 4, "100mbit") == pytest.approx(120.0)  # 2(W−1)/W payloads
    # hierarchical: the bytes on the node's link as they are
    assert demo.link_seconds(1e9, "allgather", 4, "1gbit", node_link_bytes=5e8) == pytest.approx(4.0)


# Runs a command with rich and matplotlib hidden (as after a plain ``pip install gradzip``), in
# this process and in every process it spawns (sitecustomize runs at each interpreter's start).
_HIDE_EXTRAS = "import sys\nfor name in ('rich', 'matplotlib'):\n    sys.modules[name] = None\n"


def _without_extras(workdir, *argv, hide=_HIDE_EXTRAS):
    """Starts the command in ``workdir``, its own folder (several run at once); wait with _done."""
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(hide)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "gradzip", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=workdir,
    )


@pytest.mark.timeout(150)
def test_commands_run_without_the_optional_extras(tmp_path):
    # four independent commands: started together, then checked one by one
    started = []
    try:
        started.append(_without_extras(
            tmp_path / "table", "bench", "codecs", "--codecs", "none,maxmin:bits=2", "--numel", "4096", "--repeats", "1",
            "--json", str(tmp_path / "codecs.json"),
        ))
        started.append(_without_extras(  # an explicit --plot cannot be honoured: a clear error, not a traceback
            tmp_path / "plot", "bench", "codecs", "--codecs", "none", "--numel", "4096", "--repeats", "1",
            "--plot", str(tmp_path / "p.png"),
        ))
        started.append(_without_extras(
            tmp_path / "demo-run", "demo", "--workers", "2", "--epochs", "1", "--width", "32", "--batch-size", "64",
            "--rate", "loopback", "--configs", "fp32,maxmin4", "--out", str(tmp_path / "demo"),
        ))
        started.append(_without_extras(
            tmp_path / "no-sklearn", "demo", "--rate", "loopback", hide=_HIDE_EXTRAS + "sys.modules['sklearn'] = None\n",
        ))
        table, plot, demo_run, no_sklearn = [completed(p) for p in started]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.communicate()

    proc = table
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.split()[:3] == ["codec", "family", "bits/elem"])
    row = next(ln for ln in lines if ln.split()[:1] == ["maxmin:bits=2"])
    assert len(row.split()) == 12 and "enc+new dec ms" in header  # one cell per column, aligned under it
    assert len(row.rstrip()) == len(header.rstrip())  # the last column right-aligned under its header
    assert "━" not in proc.stdout and "─" not in proc.stdout  # no rich rendering
    assert "pip install gradzip[bench]" in proc.stdout  # names the extra
    assert "no plot: matplotlib is not installed (pip install gradzip[bench])" in proc.stdout
    assert json.loads((tmp_path / "codecs.json").read_text())["rows"][1]["codec"] == "maxmin:bits=2"
    assert not (tmp_path / "codecs.png").exists()

    proc = plot
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no plot: matplotlib is not installed (pip install gradzip[bench])" in proc.stderr

    proc = demo_run
    assert proc.returncode == 0, proc.stderr
    assert "cannot show a gain" in proc.stdout.splitlines()[1]
    assert any(ln.split()[:1] == ["maxmin4"] and "yes" in ln.split() for ln in proc.stdout.splitlines())
    assert "no plot: matplotlib is not installed (pip install gradzip[demo])" in proc.stdout
    assert json.loads((tmp_path / "demo" / "results.json").read_text())["plot"] is None

    proc = no_sklearn
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "pip install gradzip[demo]" in proc.stderr


def test_demo_rejects_unknown_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--configs", "fp32,nope"])
    err = capsys.readouterr().err
    assert "nope" in err and "maxmin4" in err  # names the culprit and lists the choices
    with pytest.raises(SystemExit):
        cli.main(["demo", "--rate", "fast"])
    assert "'fast'" in capsys.readouterr().err  # checked before any rank starts


@pytest.mark.timeout(120)
def test_bench_allreduce(tmp_path):
    path = tmp_path / "bench.json"
    plot = tmp_path / "plot.png"
    rc = cli.main([
        "bench", "allreduce", "--workers", "2", "--size-mb", "1", "--repeats", "1",
        "--codecs", "fp16,topk:ratio=0.01", "--json", str(path), "--plot", str(plot),
    ])
    assert rc == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["method"] for r in rows] == ["fp32", "maxmin:bits=4", "fp16", "topk:ratio=0.01"]
    for r in rows:
        assert r["median_s"] > 0 and r["wire_bytes"] > 0 and r["busbw_gbps"] > 0
    assert rows[0]["speedup"] == 1.0
    assert rows[2]["rel_error"] < 1e-2  # fp16 is nearly exact
    assert all(r["size_mb"] == 1.0 for r in rows)
    assert _is_png(plot) and not (tmp_path / "bench.png").exists()  # --plot wins over the JSON's name


def _is_png(path) -> bool:
    return os.path.getsize(path) > 8 and pathlib.Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_bench_allreduce_size_sweep_with_limits_and_plots(tmp_path):
    path = tmp_path / "sweep.json"
    rc = cli.main([
        "bench", "allreduce", "--workers", "2", "--sizes", "1,2", "--repeats", "1",
        "--codecs", "fp16", "--json", str(path),
    ])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["sizes_mb"] == [1.0, 2.0] and report["cores"] >= 1
    rows = report["rows"]
    assert [(r["size_mb"], r["method"]) for r in rows] == [
        (size, method) for size in (1.0, 2.0) for method in ("fp32", "maxmin:bits=4", "fp16")
    ]
    for r in rows:
        assert len(r["codec_cpu_s"]) == 2  # one figure per rank
        assert r["wire_limit_s"] is None  # loopback: no link rate
        if r["method"] == "fp32":
            assert r["speedup"] == 1.0 and r["codec_limit_s"] == 0 and r["limit_s"] is None
        else:
            assert r["codec_limit_s"] > 0
            assert r["limit_s"] >= r["codec_limit_s"]
            assert r["vs_limit"] == pytest.approx(r["median_s"] / r["limit_s"])
    assert _is_png(tmp_path / "sweep.png")  # next to the JSON, same name


def test_codec_limit_is_the_busiest_rank_or_the_work_spread_over_the_cores():
    assert codec_limit([1.0, 3.0], cores=2) == 3.0
    assert codec_limit([1.0, 1.0, 1.0, 1.0], cores=2) == 2.0
    assert codec_limit([], cores=2) == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "0"], "positive"),
    (["--sizes", "abc"], "abc"),
    (["--sizes", "1,,2"], "''"),
    (["--sizes", "1,2", "--size-mb", "4"], "not allowed with"),
    (["--size-mb", "-1"], "positive"),
])
def test_bench_allreduce_rejects_bad_sizes(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "allreduce", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_spec_names_a_memory_or_collective_as_written():
    from gradzip.bench.micro import parse_spec

    # "none" is the memory of that name (no error feedback), not the codec's default
    assert parse_spec("powersgd:rank=2:memory=none:collective=allreduce:fusion=none") == (
        "powersgd", {"rank": 2, "memory": "none", "collective": "allreduce", "fusion": None})


def test_bench_codecs(tmp_path):
    path = tmp_path / "codecs.json"
    plot = tmp_path / "roofline.png"
    rc = cli.main([
        "bench", "codecs", "--codecs", "none,maxmin:bits=2,topk", "--numel", "4096", "--repeats", "1",
        "--json", str(path), "--plot", str(plot),
    ])
    assert rc == 0
    report = json.loads(path.read_text())
    rows = {r["codec"]: r for r in report["rows"]}
    assert rows["none"]["bits_per_element"] == 32
    assert 2 < rows["maxmin:bits=2"]["bits_per_element"] < 2.1  # 2 bits + a min/scale pair per 1024
    assert rows["topk"]["bits_per_element"] < 1
    assert all(r["encode_decode_ms"] > 0 for r in rows.values())
    assert report["copy_gbps"] > 0
    assert _is_png(plot) and not (tmp_path / "codecs.png").exists()  # --plot wins over the JSON's name
    assert report["device"] == "cpu"
    assert all(r["encode_vs_copy"] > 0 and r["decode_vs_copy"] > 0 for r in rows.values())
    assert "copy_stream_ms" not in report  # a CPU call runs where it is issued: nothing to queue
    # encoded where a collective lends its buffers, as in an exchange, where the form is known first
    assert rows["maxmin:bits=2"]["encode_into_buffers"] and not rows["topk"]["encode_into_buffers"]
    assert isinstance(report["huge_pages"], str) and report["huge_pages"]


def test_bench_codecs_device(capsys):
    """``--device`` takes cpu or cuda[:index], one this machine has; anything else is refused
    at the command line with the reason."""
    for device in ("tpu", "cuda:99" if torch.cuda.is_available() else "cuda"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "codecs", "--device", device])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--device" in err and ("cpu or cuda" in err or "CUDA device" in err), err


_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device,workers", [  # one CPU case: one rank or two run the same code there
    ("cpu", 2), pytest.param("cuda", 1, marks=_CUDA), pytest.param("cuda", 2, marks=_CUDA),
])
def test_bench_overhead(tmp_path, device, workers):
    """A real ResNet-18 step per method beside fp32 DDP's: what each hook adds on one rank, and
    the speed against fp32 DDP where ranks share the device and exchange over gloo (on the CPU
    with every DDP's gradients as views of its buckets)."""
    path = tmp_path / "overhead.json"
    traces = tmp_path / "traces"
    view = ["--bucket-view"] if device == "cpu" else []
    rc = cli.main(["bench", "overhead", "--device", device, "--models", "resnet18", "--configs", "maxmin4,torch-fp16,maxmin:bits=2",
                   "--steps", "4", "--warmup", "2", "--workers", str(workers), "--json", str(path), "--profile",
                   "--trace", str(traces), *view])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["workers"] == workers and ("NCCL" in report["device_name"]) == (device == "cuda" and workers == 1)
    assert report["bucket_view"] == bool(view) and ("bucket views" in report["device_name"]) == bool(view)
    (model,) = report["models"]
    rows = {r["method"]: r for r in model["rows"]}
    assert list(rows) == ["fp32", "maxmin4", "torch-fp16", "maxmin:bits=2"]  # fp32 first, always
    assert rows["maxmin:bits=2"]["payload_bytes"] < rows["maxmin4"]["payload_bytes"]  # a codec spec, 2 bits
    assert rows["fp32"]["overhead_s"] == 0 and model["compute_s"] > 0
    assert rows["fp32"]["payload_bytes"] == 4 * model["numel"] == 2 * rows["torch-fp16"]["payload_bytes"]
    assert 0 < rows["maxmin4"]["payload_bytes"] < rows["torch-fp16"]["payload_bytes"]  # 4 bits and the plain ones
    assert all(r["step_s"] > 0 and r["hide_gbps"] > 0 and r["vs_fp32"] > 0 for r in rows.values())
    # turn by turn (two turns of two steps): fp32 against itself adds nothing; the quartiles hold the median
    assert rows["fp32"]["paired_overhead_s"] == [0.0, 0.0, 0.0]
    assert all(len(r["step_times_s"]) == 4 and r["step_s"] == statistics.median(r["step_times_s"]) for r in rows.values())
    assert all(q1 <= mid <= q3 for mid, q1, q3 in (r["paired_overhead_s"] for r in rows.values()))
    # every rank profiled the same steps (each is a collective); rank 0's operator tables kept
    assert all("aten::" in r["profile"] for r in rows.values())
    # and its Chrome traces, one per method, the spec's ':' and '=' made file-safe
    assert sorted(p.name for p in traces.iterdir()) == sorted(
        f"resnet18-{m}.json.gz" for m in ("fp32", "maxmin4", "torch-fp16", "maxmin_bits_2"))
    with gzip.open(rows["maxmin4"]["trace"]) as f:
        assert any(e.get("name", "").startswith("aten::") for e in json.load(f)["traceEvents"])


def test_bench_overhead_rejects_unknown_models_and_methods(capsys):
    for argv in (["--models", "resnet51"], ["--configs", "maxmin5"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "overhead", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert ("choose from" in err or "one of" in err) and argv[1] in err
    # a memory or collective that does not exist, or that the codec cannot use: refused before any rank starts
    for spec, said in (("maxmin:memory=bogus", "unknown memory 'bogus'"), ("maxmin:collective=bogus", "unknown collective"),
                       ("topk:collective=sra", "valid collectives for it: allgather")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "models", "--configs", spec])
        assert exc.value.code == 2 and said in capsys.readouterr().err, spec
    # FSDP2's: a codec that cannot compress a sharded reduce-scatter, weight bits out of range
    for spec, said in (("powersgd", "cannot compress a sharded reduce-scatter; codecs that can: bf16"),
                       ("maxmin:weight_bits=9", "weight_bits must be an integer in 2..8, got 9"),
                       ("maxmin:memory=bogus", "unknown memory 'bogus'")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "fsdp", "--configs", spec])
        assert exc.value.code == 2 and said in capsys.readouterr().err, spec
    with pytest.raises(SystemExit, match="hangs with several DDP buckets on gloo"):  # refused before it starts
        cli.main(["bench", "overhead", "--device", "cpu", "--configs", "torch-powersgd"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_codecs_on_cuda(tmp_path):
    path = tmp_path / "codecs.json"
    rc = cli.main(["bench", "codecs", "--device", "cuda", "--codecs", "fp16,maxmin", "--numel", "1048576",
                   "--repeats", "3", "--json", str(path)])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["device"].startswith("cuda") and "triton" in report["kernels"]
    assert all(r["encode_vs_copy"] > 0 for r in report["rows"])
    # in a stream too: calls queued back to back, the launch latency hidden behind the kernels
    assert report["copy_stream_ms"] > 0 and report["streamed"] > 1
    assert all(r["encode_stream_vs_copy"] > 0 and r["decode_stream_vs_copy"] > 0 for r in report["rows"])


def _hang(rank: int, world: int) -> None:
    import time

    if rank == 1:
        time.sleep(600)  # a rank that never finishes, like one stuck in a mismatched collective


@pytest.mark.timeout(120)
def test_a_hung_job_is_killed_at_its_deadline():
    from gradzip.comm.launch import spawn_local

    with pytest.raises(RuntimeError, match="ranks still running after 5 s: killed"):
        spawn_local(_hang, 2, deadline_s=5)


def test_bench_helpers_take_bad_input_without_losing_a_run(tmp_path):
    """What a finished benchmark run does last must not fail on what it was given: a JSON path
    in a folder not made yet; and what a command is given is checked first (a rate of 0, a
    report that is not a models report over a link)."""
    from gradzip.bench import scaling, write_json

    path = tmp_path / "new" / "folder" / "r.json"
    write_json({"a": 1}, str(path))
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(ValueError, match="above 0"):
        cluster.parse_rate("0mbit")
    (tmp_path / "loop.json").write_text(json.dumps({"models": [], "workers": 2, "cores": 2, "rate": None}))
    with pytest.raises(ValueError, match="ran on loopback"):
        scaling.models_report(str(tmp_path / "loop.json"))
    with pytest.raises(ValueError, match="not a 'gradzip bench models' report"):
        scaling.models_report(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        scaling.models_report(str(tmp_path / "missing.json"))
