"""A training job for ``torchrun --max-restarts``: checkpoints every step, resumes from the last.

``python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 resume_job.py OUT KILL_AT STEPS``
trains five copies of one model side by side, plain DDP and gradzip ``maxmin`` (stochastic
rounding, error feedback), ``topk`` (error feedback), ``qsgd`` (stochastic) and ``maxmin`` through
the parameter server (its aggregators re-encode stochastically), on the same data.
In its first attempt rank 1 dies at the start of step KILL_AT (-1: never); torchrun restarts every
rank, which resume from the newest step that every rank has saved. Rank 0 writes the final
parameters to OUT/final.pt. :func:`train` is the same job for a launcher that has already
joined the process group (one torchrun per emulated node, ``spawn_local(cluster=...)``).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip

CONFIGS = {
    "ddp": None,
    "maxmin": dict(codec="maxmin", bits=2, memory="residual"),
    "topk": dict(codec="topk", ratio=0.05),
    "qsgd": dict(codec="qsgd", bits=3),
    "maxmin-ps": dict(codec="maxmin", bits=4, collective="ps"),  # aggregators re-encode stochastically
}


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    out, kill_at, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(dist.get_rank(), dist.get_world_size(), out, kill_at, steps)
    dist.destroy_process_group()


def train(rank: int, world: int, out: Path, kill_at: int, steps: int, kill_rank: int = 1) -> dict:
    """The job on a joined process group; ``kill_rank`` dies at step ``kill_at`` of the first attempt."""
    out.mkdir(parents=True, exist_ok=True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    runs = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = gradzip.register(ddp, min_numel=64, **cfg) if cfg else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        runs[name] = (model, ddp, state, opt)
    start = flat(runs["ddp"][0])

    # resume from the newest step every rank has saved
    saved = sorted(int(p.stem.split("_")[-1]) for p in out.glob(f"rank{rank}_step_*.pt"))
    newest = torch.tensor([saved[-1] if saved else -1])
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    first = int(newest) + 1
    if first > 0:
        ckpt = torch.load(out / f"rank{rank}_step_{first - 1}.pt", weights_only=False)
        for name, (model, _, state, opt) in runs.items():
            model.load_state_dict(ckpt[name]["model"])
            opt.load_state_dict(ckpt[name]["opt"])
            if state is not None:
                state.load_state_dict(ckpt[name]["gradzip"])

    for step in range(first, steps):
        if step == kill_at and rank == kill_rank and restarts == 0:
            os._exit(1)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        for model, ddp, state, opt in runs.values():
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        ckpt = {
            name: {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "gradzip": state.state_dict() if state is not None else None,
            }
            for name, (model, _, state, opt) in runs.items()
        }
        tmp = out / f".rank{rank}_step_{step}.tmp"
        torch.save(ckpt, tmp)
        os.replace(tmp, out / f"rank{rank}_step_{step}.pt")

    final = {name: flat(model) for name, (model, *_rest) in runs.items()}
    final.update(start=start, restarts=restarts, resumed_from=first - 1)
    final["plans"] = {name: state.plan().get("topology") for name, (_, _, state, _) in runs.items() if state is not None}
    if rank == 0:
        torch.save(final, out / "final.pt")
    for _, _, state, _ in runs.values():
        if state is not None:
            state.close()
    return final


if __name__ == "__main__":
    main()
