"""Count the torch operations that gradzip's PowerSGD issues in one backward pass of ResNet-50,
without a GPU: one rank over gloo, CPU tensors, the engine's and the memory's device choices
switched to their CUDA branches (as in ``gpu_path_ops.py``). On a GPU most of a PowerSGD hook's
time is the host time of its operations (docs/gpu.md), so this count is what to keep down.

    python scripts/powersgd_ops.py [rank]       (default 2; error feedback, as registered by default)

Prints the count and where the operations are issued. The fused groups are the size the DDP
hook makes them for CUDA gradients (``ACCELERATOR_FUSION_MB``), not the CPU's. The copies the
orthonormalisation makes for the CPU's batched products alone are counted apart.

    python scripts/powersgd_ops.py [rank] --host-time

Times the host work instead: ResNet-50's parameter shapes with their channels divided by 8 (the
same matrices and repetitions, products too small to matter), cut into DDP's 25 MiB buckets by
their real sizes, each bucket one job of the engine as the DDP hook runs it; the best of five
rounds of 30 backward passes, in milliseconds a pass.

    python scripts/powersgd_ops.py --against-torch [--repeat N]

What each PowerSGD hook adds to a DDP step where the step itself is small, so the hooks' host
work shows: ResNet-50 with its channels divided by 8 (``width=8``: its 161 parameters, 54
matrices), two 32×32 images, one rank over gloo, one thread, every gradient in one DDP bucket
(PyTorch's hook hangs on gloo with several); fp32 DDP, PyTorch's ``powerSGD_hook`` and
gradzip's ``powersgd`` (both rank 2 with error feedback, as ``gradzip bench`` runs them) timed
in turns, the median of 40 turns of two steps each, ``N`` times (default 1).
"""
import collections
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_path_ops  # noqa: E402  (puts src on the path, TRITON_INTERPRET set before Triton loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gradzip  # noqa: E402
from gradzip.bench.models import resnet50  # noqa: E402
from gradzip.frontends.ddp import ACCELERATOR_FUSION_MB  # noqa: E402
from gradzip.sync import memory  # noqa: E402


def main(rank: int) -> None:
    gpu_path_ops.accelerator_choices()
    memory.reads_on_host = lambda flag: False  # the flag stays on the device, as on a GPU
    ops, where, counting = collections.Counter(), collections.Counter(), [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            frames = traceback.extract_stack()[:-1]
            if counting[0] and name not in gpu_path_ops.VIEWS and not any("bench/models" in f.filename for f in frames):
                mine = [f for f in frames if "/gradzip/" in f.filename]
                if mine:  # issued by gradzip (its hook or its comm thread), not by the model
                    f = mine[-1]
                    ops["cpu only" if f.name == "_gram_schmidt" and name == "clone" else "ops"] += 1
                    where[f"{f.filename.split('gradzip/')[-1]}:{f.lineno} {name}"] += 1
            return func(*args, **(kwargs or {}))

    gpu_path_ops.count_on_comm_thread(Count, "29563")
    ddp = torch.nn.parallel.DistributedDataParallel(resnet50())
    state = gradzip.register(ddp, "powersgd", rank=rank, fusion_mb=ACCELERATOR_FUSION_MB)  # a GPU's groups
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,))
    for _ in range(4):  # past the warm-up; DDP's buckets rebuilt
        F.cross_entropy(ddp(x), y).backward()
    with Count():
        counting[0] = True
        F.cross_entropy(ddp(x), y).backward()
        state.comm.flush()
        counting[0] = False
    print(f"powersgd rank {rank}: {ops['ops']} torch operations in a backward pass"
          f" (and {ops['cpu only']} copies for the CPU's batched products that a GPU does not make)")
    for line, count in where.most_common(20):
        print(f"  {count:4d}  {line}")
    state.close()
    dist.destroy_process_group()


def host_time(rank: int, passes: int = 30) -> None:
    from gradzip.sync.engine import Batch
    from gradzip.sync.pipeline import drive

    gpu_path_ops.accelerator_choices()
    memory.reads_on_host = lambda flag: False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29564")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    comm = gradzip.Communicator("powersgd", rank=rank)
    buckets, bucket, size = [], [], 0
    for p in list(resnet50().parameters())[::-1]:  # DDP's order: the last layers' gradients first
        bucket.append(tuple(max(1, d // 8) if i < 2 else d for i, d in enumerate(p.shape)))
        size += p.numel() * 4
        if size >= 25 * 2**20:
            buckets.append(bucket)
            bucket, size = [], 0
    buckets.append(bucket)
    jobs = []
    for b, shapes in enumerate(buckets):  # the gradients as views of their bucket
        buffer = torch.randn(sum(torch.Size(s).numel() for s in shapes))
        views = list(torch.split(buffer, [torch.Size(s).numel() for s in shapes]))
        views = [v.view(s) for v, s in zip(views, shapes)]
        jobs.append(Batch(views, [f"b{b}.p{i}" for i in range(len(shapes))], [len(s) > 1 for s in shapes], buffer=buffer))

    def backward(step: int) -> None:
        for job in jobs:
            drive(comm.batch_stages(job, step))

    for step in range(5):
        backward(step)
    best = float("inf")
    for r in range(5):
        start = time.perf_counter()
        for step in range(5 + r * passes, 5 + (r + 1) * passes):
            backward(step)
        best = min(best, (time.perf_counter() - start) / passes)
    print(f"powersgd rank {rank}: {best * 1e3:.2f} ms of host time a backward pass ({len(jobs)} buckets)")
    comm.close()
    dist.destroy_process_group()


def against_torch(repeat: int, turns: int = 40) -> None:
    import statistics

    from gradzip.bench.methods import attach

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29565")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 100, (2,))
    steps = {}
    for label in ("fp32", "torch-powersgd", "powersgd"):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(resnet50(num_classes=100, width=8), bucket_cap_mb=1000)
        attach(ddp, label)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

        def step(ddp=ddp, opt=opt) -> None:
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()

        steps[label] = step
    for step in steps.values():  # past the warm-ups (PyTorch's hook starts at iteration 2)
        for _ in range(10):
            step()
    for _ in range(repeat):
        times = {label: [] for label in steps}
        for _ in range(turns):
            for label, step in steps.items():
                start = time.perf_counter()
                step()
                step()
                times[label].append((time.perf_counter() - start) / 2)
        base = statistics.median(times["fp32"])
        print("  ".join(f"{label} {statistics.median(t) * 1e3:.2f} ms (+{(statistics.median(t) - base) * 1e3:.2f})"
                        for label, t in times.items()))
    dist.destroy_process_group()


if __name__ == "__main__":
    flags = {"--host-time", "--against-torch"}
    argv = sys.argv[1:]
    repeat = int(argv[argv.index("--repeat") + 1]) if "--repeat" in argv else 1
    if "--repeat" in argv:
        del argv[argv.index("--repeat") : argv.index("--repeat") + 2]
    args = [a for a in argv if a not in flags]
    rank = int(args[0]) if args else 2
    if "--against-torch" in argv:
        against_torch(repeat)
    else:
        (host_time if "--host-time" in argv else main)(rank)
