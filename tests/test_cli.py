"""Smoke tests of the ``gradzip`` command: the demo and the benchmarks.

They run the real thing (spawned gloo ranks) at tiny settings, through ``gradzip.cli.main``.
"""
from __future__ import annotations

import json
import os
import pathlib

import pytest

from gradzip import cli
from gradzip.bench.micro import codec_limit

pytest.importorskip("sklearn")
pytest.importorskip("rich")
pytest.importorskip("matplotlib")


@pytest.mark.timeout(120)
def test_demo_two_configs(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--workers", "2", "--epochs", "1", "--configs", "fp32,maxmin4", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fp32" in printed and "maxmin4" in printed
    report = json.loads((out / "results.json").read_text())
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == ["fp32", "maxmin4"]
    for r in rows.values():
        assert isinstance(r["test_accuracy"], float) and r["test_accuracy"] > 10.0  # better than chance
        assert r["identical"] is True
        assert r["wire_bytes"] > 0 and len(r["loss_per_step"]) == r["steps"] > 0
    assert rows["maxmin4"]["wire_bytes"] < rows["fp32"]["wire_bytes"]
    assert os.path.getsize(out / "demo.png") > 0


def test_demo_rejects_unknown_config(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--configs", "fp32,nope"])
    err = capsys.readouterr().err
    assert "nope" in err and "maxmin4" in err  # names the culprit and lists the choices


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


def _hang(rank: int, world: int) -> None:
    import time

    if rank == 1:
        time.sleep(600)  # a rank that never finishes, like one stuck in a mismatched collective


@pytest.mark.timeout(120)
def test_a_hung_job_is_killed_at_its_deadline():
    from gradzip.launch import spawn_local

    with pytest.raises(RuntimeError, match="ranks still running after 5 s: killed"):
        spawn_local(_hang, 2, deadline_s=5)
