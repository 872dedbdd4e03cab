"""A DDP job as a SLURM user writes it: started by torchrun on every node, or by srun alone.

Under srun without torchrun the rank's place comes from SLURM's variables (``SLURM_PROCID``,
``SLURM_NTASKS``; ``MASTER_ADDR``/``MASTER_PORT`` exported before srun), as SLURM users set it up.
gradzip gets no argument: ``GRADZIP_*`` variables exported before srun choose the codec.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip


def main(outdir: str) -> None:
    if "RANK" not in os.environ:  # srun started this rank itself
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    ddp = DDP(model)
    state = gradzip.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        ddp(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()
    torch.save({
        "params": [p.detach().clone() for p in model.parameters()],
        "topology": state.plan()["topology"],
        "codec": state.comm.codec.name, "bits": state.comm.codec.bits,
        "compressed": state.stats()["params_compressed"],
        "slurm_node": int(os.environ["SLURM_NODEID"]),
        "node": state.comm.topology.node,
    }, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
