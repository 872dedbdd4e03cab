"""SLURM launches, for real: slurmctld and one slurmd per emulated node, jobs started with srun.

Two nodes are network namespaces joined by a 1 Gbit/s link (:mod:`gradzip.bench.cluster`); a
``slurmd`` runs inside each, so every task srun starts runs on its node's network, as on
separate machines. The job (``tests/slurm_job.py``) is launched as docs/multinode.md says:
``srun`` + ``torchrun`` with a c10d rendezvous on the first node, and srun alone (one task per
rank). ``GRADZIP_*`` variables exported before srun configure gradzip on every node. Skipped
with the reason where root, iproute2 or SLURM (Debian: ``slurmd slurmctld slurm-client munge``)
is missing.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
import torch

from gradzip.comm.launch import free_port

SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sinfo", "munged", "munge")
PACKAGES = "slurmd slurmctld slurm-client munge"
JOB = Path(__file__).with_name("slurm_job.py")


def _tool(name: str) -> str:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin") or ""


def _why_not() -> str:
    from gradzip.bench import cluster

    reason = cluster.available()
    if reason:
        return f"no emulated cluster here: {reason}"
    missing = [t for t in SLURM_TOOLS if not _tool(t)]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing; Debian: apt-get install {PACKAGES})"
    if not os.path.exists("/etc/munge/munge.key"):
        return "munge has no key (/etc/munge/munge.key): SLURM cannot authenticate"
    return ""


def _conf(tmp: Path, c) -> Path:
    nodes = "\n".join(f"NodeName=node{k} NodeAddr={c.address(k)} CPUs=2 State=UNKNOWN" for k in range(c.nodes))
    text = f"""ClusterName=gzslurm
SlurmctldHost={socket.gethostname()}({c.address(0)})
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
SlurmdSpoolDir={tmp}/spool-%n
StateSaveLocation={tmp}/state
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd-%n.log
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PlugStackConfig=/dev/null
{nodes}
PartitionName=emu Nodes={','.join(f'node{k}' for k in range(c.nodes))} Default=YES MaxTime=INFINITE State=UP
"""
    (tmp / "state").mkdir()
    (tmp / "slurm.conf").write_text(text)
    # this machine mounts cgroup v1; the job needs no limits, so nothing is constrained
    (tmp / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
    return tmp / "slurm.conf"


def _munge(stack: contextlib.ExitStack) -> None:
    """munged running: started here, in the foreground as the munge user, when it is not, and
    stopped with the stack."""
    if _munge_answers():
        return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    proc = subprocess.Popen([_tool("munged"), "-F"], user="munge", group="munge",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(_end, [proc])
    deadline = time.monotonic() + 10
    while not _munge_answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail("munged did not start")
        time.sleep(0.1)


def _munge_answers() -> bool:
    """Whether a munged answers: a credential can be made."""
    return subprocess.run([_tool("munge"), "-n"], capture_output=True).returncode == 0


def _end(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _kill_everything_in(namespaces: List[str]) -> None:
    """SIGKILL every process in these namespaces: the daemons, job steps, ranks of a job that hung."""
    for ns in namespaces:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[Dict[str, object]]:
    why = _why_not()
    if why:
        pytest.skip(why)
    from gradzip.bench.cluster import EmulatedCluster

    with contextlib.ExitStack() as stack:  # undone in reverse: processes first, then the namespaces, then munged
        _munge(stack)
        c = stack.enter_context(EmulatedCluster(2, "1gbit", prefix="gzslurm", ranks_per_node=2))
        daemons: List[subprocess.Popen] = []
        stack.callback(_end, daemons)
        stack.callback(_kill_everything_in, list(c.namespaces))
        conf = _conf(tmp_path, c)
        env = dict(os.environ, SLURM_CONF=str(conf))

        def start(ns: str, *cmd: str) -> None:
            daemons.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd, "-D", "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        start(c.namespaces[0], _tool("slurmctld"), "-i")
        for k, ns in enumerate(c.namespaces):
            start(ns, _tool("slurmd"), "-N", f"node{k}")
        deadline = time.monotonic() + 60
        while True:  # both nodes registered with the controller and free
            states = subprocess.run(["ip", "netns", "exec", c.namespaces[0], _tool("sinfo"), "-h", "-N", "-o", "%T"],
                                    env=env, capture_output=True, text=True).stdout.split()
            if states == ["idle"] * c.nodes:
                break
            if time.monotonic() > deadline:
                logs = "".join(p.read_text()[-1500:] for p in tmp_path.glob("slurm*.log"))
                pytest.fail(f"SLURM nodes not idle after 60 s ({states}):\n{logs}")
            time.sleep(0.5)
        yield {"cluster": c, "env": env, "tmp": tmp_path}


def _srun(slurm: Dict[str, object], srun_args: List[str], command: str, **env_vars: str) -> List[dict]:
    """``srun`` from the first node, the job's environment exported before it; each rank's record."""
    c, tmp = slurm["cluster"], slurm["tmp"]
    out = tmp / "out"
    out.mkdir()
    env = {k: v for k, v in slurm["env"].items() if not k.startswith(("GRADZIP_", "SLURM_")) or k == "SLURM_CONF"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=c.iface,
               GRADZIP_CODEC="maxmin", GRADZIP_BITS="2", GRADZIP_MIN_NUMEL="1000", **env_vars)
    cmd = ["ip", "netns", "exec", c.namespaces[0], _tool("srun"), *srun_args, "--kill-on-bad-exit=1",
           "bash", "-c", command.format(python=sys.executable, job=JOB, out=out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


def _check(records: List[dict]) -> None:
    for rank, rec in enumerate(records):
        assert all(torch.equal(a, b) for a, b in zip(rec["params"], records[0]["params"])), rank  # replicas identical
        assert (rec["codec"], rec["bits"]) == ("maxmin", 2)  # GRADZIP_* reached every node unchanged
        assert rec["compressed"] > 0
        topo = rec["topology"]
        assert topo["hierarchical"] and topo["topology"] == "2 nodes x 2 ranks", topo
        assert rec["node"] == rec["slurm_node"] == rank // 2  # gradzip's nodes are SLURM's


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_srun_with_torchrun_on_every_node_as_the_docs_say(slurm):
    c = slurm["cluster"]
    # the recipe of docs/multinode.md; the emulated nodes share one host name, so each says which
    # address it has and whether it holds the rendezvous (real machines need neither)
    command = (
        "{python} -m torch.distributed.run --nnodes $SLURM_NNODES --nproc-per-node 2 --rdzv-backend c10d "
        f"--rdzv-endpoint {c.address(0)}:{free_port()} --rdzv-id $SLURM_JOB_ID "
        "--rdzv-conf is_host=$((SLURM_NODEID == 0)) "
        "--local-addr $(ip -4 -o addr show eth0 | awk '{{print $4}}' | cut -d/ -f1) "
        "{job} {out}"
    )
    records = _srun(slurm, ["-N", "2", "--ntasks-per-node", "1"], command)
    _check(records)
    assert records[0]["topology"]["found_from"] == "GROUP_RANK"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_srun_alone_one_task_per_rank_finds_the_nodes_from_slurm(slurm):
    c = slurm["cluster"]
    records = _srun(slurm, ["-N", "2", "--ntasks-per-node", "2"], "exec {python} {job} {out}",
                    MASTER_ADDR=c.address(0), MASTER_PORT=str(free_port()))
    _check(records)
    assert records[0]["topology"]["found_from"] == "SLURM_NODEID"
