"""Tiny training jobs through Accelerate, the Hugging Face Trainer and Ray Train, each with
gradzip registered by :mod:`gradzip.frontends.recipes`; every rank writes what it saw to OUTDIR.

``accelerate launch --cpu --num_processes 2 tests/recipes_job.py accelerate OUTDIR``,
``torchrun --nproc-per-node 2 tests/recipes_job.py trainer OUTDIR``,
``python tests/recipes_job.py ray OUTDIR`` (Ray starts its own two workers).
"""
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import gradzip.frontends.recipes


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 4, (256,), generator=g))


def save(outdir: str, rank: int, world_size: int, state, module: torch.nn.Module, **extra) -> None:
    torch.save(
        {"world_size": world_size, "stats": state.stats(), "steps": state.step,
         "params": [p.detach().clone() for p in module.parameters()], **extra},
        os.path.join(outdir, f"rank{rank}.pt"),
    )


def accelerate_job(outdir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = mlp()
    try:  # the model before prepare(): refused, it is no DDP model
        gradzip.frontends.recipes.register_accelerate(accelerator, model, "maxmin")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data(), batch_size=16)  # 8 batches per rank: 4 optimizer steps
    model, opt, loader = accelerator.prepare(model, opt, loader)
    compiled = torch.nn.Module()
    compiled._orig_mod = model  # how torch.compile holds the model it compiled
    found = gradzip.frontends.recipes.find_ddp(compiled) is model
    state = gradzip.frontends.recipes.register_accelerate(accelerator, model, "maxmin", bits=4, min_numel=256)
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    save(outdir, accelerator.process_index, accelerator.num_processes, state, accelerator.unwrap_model(model),
         distributed_type=str(accelerator.distributed_type), refused=refused, found=found)


class _Classifier(torch.nn.Module):
    """The Trainer's model contract: keyword inputs in, a dict with the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


def trainer_job(outdir: str) -> None:
    from transformers import Trainer, TrainingArguments

    xs, ys = data().tensors
    rows = [{"x": x, "labels": y} for x, y in zip(xs, ys)]
    args = TrainingArguments(
        output_dir=os.path.join(outdir, "trainer"), use_cpu=True, ddp_backend="gloo", max_steps=5,
        per_device_train_batch_size=16, learning_rate=0.1, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    model = _Classifier()
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    callback = gradzip.frontends.recipes.register_trainer(trainer, "maxmin", bits=4, min_numel=256)
    trainer.train()
    first = callback.state
    trainer.train()  # again, on the same DDP model: the hook and its state stay
    save(outdir, args.process_index, args.world_size, callback.state, model,
         wrapped=type(trainer.model_wrapped).__name__, same_state=callback.state is first)


def ray_job(outdir: str) -> None:
    import ray
    import ray.train
    import ray.train.torch
    from ray.train.torch import TorchTrainer

    def loop(config) -> None:
        torch.set_num_threads(1)
        model = ray.train.torch.prepare_model(mlp())
        state = gradzip.frontends.recipes.register_prepared(model, "maxmin", bits=4, min_numel=256)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = ray.train.torch.prepare_data_loader(DataLoader(data(), batch_size=16))
        for _, (x, y) in zip(range(5), loader):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        ctx = ray.train.get_context()
        save(config["outdir"], ctx.get_world_rank(), ctx.get_world_size(), state, model.module)

    # logical CPUs: one per worker and, in Ray Train's older engine, one for the trainer actor
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        TorchTrainer(
            loop, train_loop_config={"outdir": outdir},
            scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
            run_config=ray.train.RunConfig(storage_path=os.path.join(outdir, "ray"), name="job"),
        ).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"accelerate": accelerate_job, "trainer": trainer_job, "ray": ray_job}[sys.argv[1]](sys.argv[2])
