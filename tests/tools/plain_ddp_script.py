"""A DDP training script that knows nothing of gradzip (for ``gradzip run`` tests; torch only).

``python plain_ddp_script.py OUTDIR [--own-hook] [--compile]``, launched by torchrun or ``gradzip run``:
trains a small MLP a few steps with gloo and writes what each rank saw to ``OUTDIR/rank<r>.json``.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    if "--own-hook" in sys.argv:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model, backend="eager") if "--compile" in sys.argv else model  # torch.compile(DDP(m))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(5):
        x = torch.randn(32, 64, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    facts = {
        "rank": rank,
        "world": world,
        "hooks": [getattr(h, "__qualname__", str(h)) for h, _ in model._comm_hooks],
        "replicas_identical": all(torch.equal(g, gathered[0]) for g in gathered),
        "params": flat.tolist(),
    }
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
