"""``gradzip run``: a torch-only DDP script, launched as with torchrun, trains compressed.

Every test launches real processes through the real command (``python -m gradzip run``, which
uses ``torch.distributed.run``) on two local gloo ranks; the script writes what each rank saw.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from ..dist_utils import completed

SCRIPT = str(Path(__file__).with_name("plain_ddp_script.py"))
SUMMARY = re.compile(r"^gradzip run: (\S+) on 1 DDP model: ratio ([0-9.]+)x", re.M)


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADZIP_", "PET_"))}
    env.update(extra)
    return env


def _start(launcher: List[str], out: Path, *script_args: str, **env: str) -> subprocess.Popen:
    out.mkdir()
    return subprocess.Popen(
        [*launcher, "--nproc-per-node", "2", SCRIPT, str(out), *script_args],
        env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finish(proc: subprocess.Popen, out: Path) -> Tuple[subprocess.CompletedProcess, list]:
    done = completed(proc)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()]
    return done, ranks


GRADZIP_RUN = [sys.executable, "-m", "gradzip", "run"]

# (launcher, script arguments, environment) of each job the tests below look at
JOBS = {
    "gz": ([*GRADZIP_RUN, "--codec", "maxmin", "--bits", "4"], (), {}),
    "own": ([*GRADZIP_RUN, "--codec", "maxmin"], ("--own-hook",), {}),
    "env": (GRADZIP_RUN, (), {"GRADZIP_CODEC": "qsgd", "GRADZIP_BITS": "2"}),
    "compiled": ([*GRADZIP_RUN, "--codec", "maxmin", "--bits", "4"], ("--compile",), {}),
}


def _launched(root: Path, *names: str) -> Dict[str, Tuple[subprocess.CompletedProcess, list]]:
    """The jobs of JOBS named, launched at once (each waits on its own ranks' rendezvous much of
    the time); the finished ones by name."""
    procs = {}
    try:
        for name in names:
            launcher, args, env = JOBS[name]
            procs[name] = _start(launcher, root / name, *args, **env)
        return {name: _finish(proc, root / name) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _trained_compressed(job: Tuple[subprocess.CompletedProcess, list], codec: str) -> List[float]:
    """Checks a job that gradzip compressed with ``codec``; rank 0's parameters."""
    proc, ranks = job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(ranks) == 2
    assert all(r["hooks"] == ["gradzip_hook"] and r["replicas_identical"] for r in ranks), ranks
    (found_codec, ratio), = SUMMARY.findall(proc.stdout)  # rank 0 only
    assert found_codec == codec and float(ratio) > 3.0, proc.stdout
    return ranks[0]["params"]


@pytest.mark.timeout(240)
def test_an_unedited_script_trains_compressed_and_so_does_one_that_compiles_its_ddp_model(tmp_path):
    jobs = _launched(tmp_path, "gz", "compiled")
    plain = _trained_compressed(jobs["gz"], "maxmin(bits=4)")
    # torch.compile(DDP(model)): gradzip registers at the first forward, which is being traced
    compiled = _trained_compressed(jobs["compiled"], "maxmin(bits=4)")
    assert "already has a communication hook" not in jobs["compiled"][0].stderr  # registered once
    assert compiled == plain  # the same exchanges, bit for bit (the eager backend computes as eager)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_script_with_its_own_hook_keeps_it_and_gradzip_variables_configure_the_others(tmp_path):
    jobs = _launched(tmp_path, "own", "env")
    # GRADZIP_* variables alone (no flags) choose the codec of every rank
    compressed = _trained_compressed(jobs["env"], "qsgd(bits=2)")
    # the script registers PyTorch's plain all-reduce hook: gradzip leaves that model alone,
    # and it trains uncompressed (the reference for the weights above)
    own, own_ranks = jobs["own"]
    assert own.returncode == 0, own.stderr[-3000:]
    assert all(r["hooks"] == ["allreduce_hook"] and r["replicas_identical"] for r in own_ranks)
    assert "already has a communication hook" in own.stderr
    assert "gradzip run: no DistributedDataParallel model was compressed" in own.stdout
    diff = max(abs(a - b) for a, b in zip(compressed, own_ranks[0]["params"]))
    assert 1e-6 < diff < 0.1, diff  # compressed gradients moved the weights, a little


def test_bad_settings_fail_in_the_launcher_before_any_rank_starts(tmp_path, capsys):
    from gradzip.tools import cli

    for flags, said in ((["--codec", "nosuchcodec"], "a codec that the script registers"),
                        (["--no-python"], "--no-python"),
                        (["--memory", "bogus"], "unknown memory 'bogus'; valid memories: dgc"),
                        (["--codec", "topk", "--collective", "sra"], "valid collectives for it: allgather"),
                        # a bad value names the variable it came from (an option of this command sets one)
                        (["--codec", "maxmin", "--bits", "9", "--option", "min_numel=10"],
                         "got 9 (from GRADZIP_BITS=9, GRADZIP_CODEC=maxmin)"),
                        (["--option", "partitions=2"], "partitions is an option of collective 'ps' (from "
                                                        "GRADZIP_PARTITIONS=2)")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["run", "--nproc-per-node", "2", *flags, SCRIPT, str(tmp_path)])
        assert exc.value.code == 2 and said in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_worker_environment_sets_gradzip_variables_over_existing_ones():
    from gradzip.tools import run

    args = run.build_parser().parse_args(
        ["--nproc-per-node", "2", "--codec", "topk", "--option", "ratio=0.01", "train.py", "--codec", "x"]
    )
    assert args.training_script == "train.py" and args.training_script_args == ["--codec", "x"]  # the script's own
    env = run.worker_environment(args, {"GRADZIP_CODEC": "qsgd", "GRADZIP_RATIO": "0.5", "PATH": "/bin"})
    assert env["GRADZIP_CODEC"] == "topk" and env["GRADZIP_RATIO"] == "0.01" and env["PATH"] == "/bin"
    assert "GRADZIP_BITS" not in env
    assert run.worker_command(args) == ["--", "train.py", "--codec", "x"]
    args = run.build_parser().parse_args(["--standalone", "-m", "pkg.train", "--epochs", "1"])
    assert run.worker_command(args) == ["--module", "pkg.train", "--epochs", "1"]
