"""The scaling model: what it must say whatever its rates, and its checks."""
from __future__ import annotations

import pytest

from gradzip.policy import scaling
from gradzip.policy.scaling import Rates, predict

N = 25_557_032  # ResNet-50's gradients
ONE_GBIT = Rates(link_bps=1e9)


def test_a_ring_crosses_each_node_link_once_each_way_whatever_the_ranks_per_node():
    for L in (1, 2, 8):
        p = predict("fp32", 4, L, N, ONE_GBIT)
        assert p.link_bytes == pytest.approx(2 * (4 * L - 1) / (4 * L) * 4 * N)
    assert predict("fp32", 1, 8, N, ONE_GBIT).link_bytes == 0  # one node: no link crossed


def test_the_hierarchy_sends_one_compressed_copy_per_node_where_flat_sends_one_per_rank():
    r = ONE_GBIT
    hier = [predict("gradzip", 4, L, N, r).link_bytes for L in (2, 4, 8)]
    assert hier[0] == pytest.approx(hier[1]) == pytest.approx(hier[2])
    assert hier[0] == pytest.approx(2 * 3 / 4 * r.payload_ratio * 4 * N)
    flat = [predict("gradzip-flat", 4, L, N, r).link_bytes for L in (2, 4, 8)]
    assert flat[0] < flat[1] < flat[2] and flat[0] > hier[0]


def test_compression_pays_on_slow_links_and_stops_paying_when_the_codec_is_the_limit():
    slow = scaling.speedups(N, ONE_GBIT, [16], [8])[0]
    assert slow["vs_fp32"] > 4 and slow["vs_fp16"] > 2 and slow["bound"] == "wire"
    # one rank per node: every rank encodes all its gradients, and past some rate that costs more
    # than the fp16 hook's transfer
    fast = scaling.speedups(N, ONE_GBIT.with_(link_bps=400e9), [16], [1])[0]
    assert fast["vs_fp16"] < 1 and fast["bound"] == "cpu"
    even = scaling.break_even_bps(N, ONE_GBIT, 16, 1)
    assert even is not None and 1e9 < even < 400e9
    assert slow["vs_fp16"] > 1 > fast["vs_fp16"]


def test_ranks_sharing_cores_stretch_the_cpu_part_only():
    alone = predict("gradzip", 2, 2, N, ONE_GBIT, compute_s=0.1)
    shared = predict("gradzip", 2, 2, N, ONE_GBIT.with_(ranks_per_core=2.0), compute_s=0.1)
    assert shared.cpu_s == pytest.approx(2 * alone.cpu_s) and shared.wire_s == alone.wire_s


def test_bad_input_names_the_choices():
    with pytest.raises(ValueError, match="fp32, fp16, gradzip-flat, gradzip"):
        predict("powersgd", 2, 2, N, ONE_GBIT)
    with pytest.raises(ValueError, match="positive"):
        predict("fp32", 0, 2, N, ONE_GBIT)


def test_the_report_validates_rows_it_knows_and_plots(tmp_path):
    from gradzip.bench import scaling as bench_scaling

    report = {
        "workers": 4, "ranks_per_node": 2, "rate": "1gbit", "cores": 2,
        "models": [{
            "model": "resnet50", "numel": N, "compute_cpu_s": [0.1, 0.1, 0.1, 0.1], "buckets": 4,
            "rows": [{"method": "fp32", "median_s": 1.4}, {"method": "maxmin4", "median_s": 0.7},
                     {"method": "topk", "median_s": 0.5}],
        }],
    }
    rows = bench_scaling.validate(report, ONE_GBIT)
    assert [r["method"] for r in rows] == ["fp32", "maxmin4"]  # topk: not a row the model knows
    fp32 = rows[0]
    assert fp32["error"] == pytest.approx(fp32["predicted_s"] / 1.4 - 1)
    grid = scaling.speedups(N, ONE_GBIT, bench_scaling.NODES, bench_scaling.RANKS)
    out = {"values": N, "grid": [dict(g, link_bps=gbit * 1e9) for gbit in bench_scaling.LINKS_GBIT for g in grid],
           "validation": rows}
    assert len(bench_scaling.tables(out)) == 2
    pytest.importorskip("matplotlib")
    bench_scaling.plot(out, str(tmp_path / "scale.png"))
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_the_rates_measured_here_are_positive_and_the_codec_costs_more_than_a_copy():
    from gradzip.bench import scaling as bench_scaling

    rates = bench_scaling.cpu_rates(1 << 18)
    assert all(v > 0 for v in rates.values()), rates
    assert rates["encode_s_per_value"] > rates["copy_s_per_byte"] * 4  # it reads, finds min/max, packs
    assert rates["payload_ratio"] == pytest.approx(0.127, abs=0.01)  # 4 bits + two fp32 per 512 values
    assert 0 < bench_scaling.socket_rate(1 << 18, repeats=2) < 1e-6


def test_bench_scale_with_saved_rates_checks_a_run_without_calibrating(tmp_path, capsys):
    import json

    from gradzip.tools import cli

    (tmp_path / "rates.json").write_text(json.dumps({"rates": {**ONE_GBIT.__dict__, "cpu_factor": [1.0] * 4}}))
    run = {
        "workers": 4, "ranks_per_node": 2, "rate": "1gbit", "cores": 2,
        "models": [{"model": "resnet50", "numel": N, "compute_cpu_s": [0.1] * 4, "buckets": 4,
                    "rows": [{"method": "fp32", "median_s": 1.4}, {"method": "maxmin4", "median_s": 0.6}]}],
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "scale.json"
    rc = cli.main(["bench", "scale", str(tmp_path / "run.json"), "--rates", str(tmp_path / "rates.json"),
                   "--json", str(out), "--plot", str(tmp_path / "scale.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [v["method"] for v in report["validation"]] == ["fp32", "maxmin4"]
    assert report["rates"]["link_efficiency"] == ONE_GBIT.link_efficiency  # not calibrated again
    text = capsys.readouterr().out
    assert "stops beating the fp16 hook" in text and "Scaling model against" in text
