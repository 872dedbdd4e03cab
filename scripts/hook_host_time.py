"""Jobs a step and the host time the DDP hook adds, on the CPU with the accelerator path's
choices (multi-tensor operations, the flag on the device): a GPT-2-like stack of 12 blocks
(layer norms, biases, 128-wide linears) in DDP buckets of 0.25 MiB and 2 MiB groups, so that,
as on a GPU, groups are larger than DDP's buckets. One gloo rank; fp32 DDP and gradzip timed
in turns, medians of 300 steps.

    python scripts/hook_host_time.py [codec spec] [--src PATH]

``--src``: the gradzip sources to time (another checkout's ``src``, to compare two versions
in alternating runs on a noisy machine).
"""
import argparse
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("spec", nargs="?", default="maxmin:bits=4")
parser.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()
sys.path.insert(0, os.path.abspath(args.src))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradzip  # noqa: E402
from gradzip.sync import device, worker  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.proj(self.qkv(self.ln1(x))[..., : x.shape[-1]])
        return x + self.out(torch.relu(self.fc(self.ln2(x))))


def main() -> None:
    device.multi_tensor = lambda where: True  # the branches a CUDA tensor takes
    device.reads_flag_on_host = lambda where: False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29583")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)

    def make():
        torch.manual_seed(0)
        return nn.parallel.DistributedDataParallel(nn.Sequential(*[Block() for _ in range(12)]), bucket_cap_mb=0.25)

    codec, *pairs = args.spec.split(":")
    opts = {"fusion_mb": 2}
    for pair in pairs:
        key, value = pair.split("=")
        opts[key] = int(value) if value.isdigit() else value
    fp32, ddp = make(), make()
    state = gradzip.register(ddp, codec, **opts)
    jobs = [0]
    submit = worker.OrderedWorker.submit

    def counted(self, fn):
        jobs[0] += 1
        return submit(self, fn)

    worker.OrderedWorker.submit = counted
    x = torch.randn(2, 128)

    def step(model):
        model(x).square().mean().backward()

    for model in (fp32, ddp):
        for _ in range(5):  # DDP rebuilds its buckets after the first
            step(model)
    jobs[0] = 0
    step(ddp)
    per_step = jobs[0]
    times = {"fp32": [], "gradzip": []}
    for _ in range(args.steps):
        for key, model in (("fp32", fp32), ("gradzip", ddp)):
            started = time.perf_counter()
            step(model)
            times[key].append(time.perf_counter() - started)
    ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
    print(f"{args.spec} ({gradzip.__file__}): {len(state.fusion_plan.groups)} groups, {per_step} jobs a step; "
          f"fp32 DDP {ms['fp32']:.2f} ms, gradzip {ms['gradzip']:.2f} ms: +{ms['gradzip'] - ms['fp32']:.2f} ms")
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
