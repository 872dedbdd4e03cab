"""The emulated cluster: namespaces, shaped links, clean-up, and the loopback fallback."""
from __future__ import annotations

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from gradzip.bench import cluster, micro
from gradzip.comm.launch import spawn_local

REASON = cluster.available()


def _prefix(test: str) -> str:
    """A prefix of this test's own: a cluster clears every namespace of its prefix when it
    starts, and these tests may run at once in several workers, or several suites at once."""
    return f"{cluster.own_prefix('t')}{test}"


def _leftovers(prefix: str):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_parse_rate():
    assert cluster.parse_rate("100mbit") == 100e6
    assert cluster.parse_rate("1gbit") == 1e9
    assert cluster.parse_rate("2.5Gbit") == 2.5e9
    with pytest.raises(ValueError, match="100mbit"):
        cluster.parse_rate("fast")


def _timed_allreduce(rank: int, world: int, numel: int) -> dict:
    import os

    t = torch.full((numel,), float(rank))
    dist.all_reduce(t)  # warm-up: connections are set up
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    dist.barrier()
    return {"seconds": time.perf_counter() - t0, "value": t[0].item(), "iface": os.environ.get("GLOO_SOCKET_IFNAME")}


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
@pytest.mark.timeout(300)
def test_links_are_shaped_to_the_rate_and_everything_is_removed():
    prefix = _prefix("links")
    numel = 2**20 // 4 * 2  # 2 MiB of fp32
    with cluster.EmulatedCluster(2, "50mbit", prefix=prefix) as c:
        assert sorted(_leftovers(prefix)) == sorted(c.namespaces + [c.switch])
        results = spawn_local(_timed_allreduce, 2, numel, all_ranks=True, cluster=c)
    assert _leftovers(prefix) == []
    # a ring all-reduce on 2 ranks sends 2(W-1)/W = 1 × the tensor per rank: 2 MiB at 50 Mbit/s
    limit = 2 * 2**20 * 8 / 50e6
    for r in results:
        assert r["value"] == 2.0  # (0 + 1), then summed once more by the timed call
        assert r["iface"] == cluster.IFACE
        assert limit * 0.8 < r["seconds"] < limit * 4, (r["seconds"], limit)


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_cleanup_on_error_inside_the_block():
    prefix = _prefix("error")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster.EmulatedCluster(2, "1gbit", prefix=prefix):
            assert len(_leftovers(prefix)) == 3
            raise RuntimeError("boom")
    assert _leftovers(prefix) == []


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_leftovers_of_a_killed_run_are_removed_first():
    prefix = _prefix("killed")
    subprocess.run(["ip", "netns", "add", f"{prefix}7"], check=True)
    with cluster.EmulatedCluster(1, "1gbit", prefix=prefix):
        assert f"{prefix}7" not in _leftovers(prefix)
    assert _leftovers(prefix) == []


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_own_prefix_removes_the_namespaces_of_runs_no_longer_alive():
    """A run's own prefix holds its process id; the namespaces of a process that is gone are
    removed when the next run takes its prefix, those of a live one are left alone."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        dead, live = f"gzq{gone.pid}x0", f"gzq{alive.pid}x0"
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        assert cluster.own_prefix("q") == f"gzq{os.getpid()}x"
        assert _leftovers("gzq") == [live]
    finally:
        alive.kill()
        alive.wait()
        cluster.EmulatedCluster.cleanup("gzq")
    assert _leftovers("gzq") == []


def test_benchmark_falls_back_to_loopback_and_says_why(monkeypatch):
    monkeypatch.setattr(cluster, "available", lambda: "network namespaces and tc need root")
    report = micro.run_allreduce(workers=2, size_mb=0.25, repeats=1, rate="1gbit")
    assert report["network"] == "loopback (no emulation: network namespaces and tc need root)"
    assert all(r["wire_limit_s"] is None for r in report["rows"])


@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
@pytest.mark.timeout(300)
def test_demo_trains_on_the_emulated_cluster_with_pytorchs_hook_as_baseline():
    pytest.importorskip("sklearn")
    from gradzip.tools.demo import run_demo

    report = run_demo(["torch-fp16", "maxmin4"], out=None, workers=2, epochs=1, rate="1gbit")
    assert report["network"].startswith("2 ranks in network namespaces")
    rows = {r["config"]: r for r in report["results"]}
    assert rows["torch-fp16"]["method"] == "PyTorch fp16_compress_hook"
    assert all(r["identical"] and r["test_accuracy"] > 50 for r in rows.values())
    assert rows["maxmin4"]["wire_bytes"] < rows["torch-fp16"]["wire_bytes"]
    assert cluster.EmulatedCluster.cleanup(cluster.own_prefix("d")) == []  # nothing left behind


def _node_and_cross(rank: int, world: int, numel: int) -> dict:
    import os

    node = [r for r in range(world) if r // 2 == rank // 2]
    cross = [r for r in range(world) if r % 2 == rank % 2]
    groups = {}
    for name, members in (("node", [[0, 1], [2, 3]]), ("cross", [[0, 2], [1, 3]])):
        for ranks in members:  # every rank creates every group, in one order
            g = dist.new_group(ranks)
            if rank in ranks:
                groups[name] = g
    out = {
        "env": (os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]),
        "torchrun": "TORCHELASTIC_RUN_ID" in os.environ,
    }
    for name in ("node", "cross"):
        t = torch.ones(numel)
        dist.all_reduce(t, group=groups[name])  # connections
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t, group=groups[name])
        out[name] = time.perf_counter() - t0
    assert node and cross
    return out


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
@pytest.mark.timeout(300)
def test_ranks_of_a_node_share_its_namespace_and_only_traffic_between_nodes_is_shaped():
    prefix = _prefix("nodes")
    numel = 2**20 // 4 * 2  # 2 MiB of fp32
    with cluster.EmulatedCluster(2, "50mbit", prefix=prefix, ranks_per_node=2) as c:
        assert len(c.namespaces) == 2 and [c.namespace_of(r) for r in range(4)] == [c.namespaces[0]] * 2 + [c.namespaces[1]] * 2
        assert "2 nodes x 2 ranks" in c.describe()
        results = spawn_local(_node_and_cross, 4, numel, all_ranks=True, cluster=c)
    assert _leftovers(prefix) == []
    limit = 2 * 2**20 * 8 / 50e6  # 2 ranks: one tensor per rank over the link
    for rank, r in enumerate(results):
        assert r["torchrun"] and r["env"] == (str(rank // 2), str(rank % 2), "2")  # one torchrun per node
        assert r["cross"] > limit * 0.8, r  # between nodes: the shaped link
        assert r["node"] < limit / 4, r  # inside a node: loopback, not the link
