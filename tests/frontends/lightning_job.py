"""A tiny Lightning fit with GradzipDDPStrategy; each rank writes what it saw to OUTDIR.

Run as ``python tests/lightning_job.py OUTDIR [STEPS]``: Lightning's default launcher starts
rank 0 here and re-executes this script for the other rank.
"""
import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradzip.frontends.lightning import GradzipDDPStrategy


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(outdir: str, steps: int) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 32), torch.randint(0, 4, (256,)))
    strategy = GradzipDDPStrategy("maxmin", bits=4, min_numel=256, memory="residual")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=16))
    state = strategy.gradzip
    torch.save(
        {
            "world_size": trainer.world_size,
            "stats": state.stats(),
            "options": dict(state.config.options),
            "memory": state.config.memory,
            "sources": dict(state.config.sources),
            "params": [p.detach().clone() for p in model.parameters()],
            "steps": state.step,
        },
        os.path.join(outdir, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
