"""Count the torch operations and Triton launches of gradzip's comm thread per step on the
accelerator path, without a GPU: the engine's and the SRA's device choices are switched to
their CUDA branches and the Triton kernels run in Triton's interpreter on CPU tensors (one rank
over gloo, a 24-layer MLP in 1 MiB groups). On a GPU each operation costs host time in the
comm thread, which is what the 4-bit hook's overhead is made of (docs/gpu.md).

    python scripts/gpu_path_ops.py maxmin:bits=4                 (no error feedback)
    python scripts/gpu_path_ops.py maxmin:bits=4:memory=residual

Prints the operations per step and per group of the plan (views excluded) and where they are
issued.
"""
import collections
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import gradzip  # noqa: E402
from gradzip.bench.micro import parse_spec  # noqa: E402
from gradzip.comm import sra  # noqa: E402
from gradzip.kernels import fused, gpu  # noqa: E402
from gradzip.sync import device, memory, worker  # noqa: E402

VIEWS = {"view", "permute", "slice", "expand", "transpose", "_unsafe_view", "_reshape_alias", "as_strided",
         "alias", "select", "unsqueeze", "squeeze", "t", "detach", "set_"}


def accelerator_choices() -> None:
    """The branches a CUDA tensor takes, for CPU tensors."""
    assert gpu.available() is None, gpu.available()
    device.multi_tensor = lambda where: True
    device.reads_flag_on_host = lambda where: False
    sra.segment_values = lambda segment, numel, device: segment if segment is not None else max(numel, 1)
    fused.backend = lambda x, bits=8, bucket=8: gpu if gpu.supports(x, bits, bucket) else fused.reference
    fused.groups_at_once = lambda device: True
    memory.reads_on_host = lambda flag: False


def count_on_comm_thread(mode: type, port: str) -> None:
    """Run the ordered worker's loop (gradzip's comm thread) under ``mode``, a
    TorchDispatchMode class, so that it sees what the thread issues, and start one gloo rank."""
    loop = worker.OrderedWorker._loop

    def counted_loop(self):
        with mode():
            loop(self)

    worker.OrderedWorker._loop = counted_loop
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)


def main(spec: str) -> None:
    accelerator_choices()
    launches, ops, where = collections.Counter(), collections.Counter(), collections.Counter()
    counting = [False]
    launch = gpu._launch

    def counted_launch(kernel, grid, device, *args, **meta):
        launches[getattr(getattr(kernel, "fn", kernel), "__name__", "?")] += 1
        return launch(kernel, grid, device, *args, **meta)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            stack = [f for f in traceback.extract_stack()[:-1] if "/gradzip/" in f.filename]
            # the interpreter's own copies of a kernel's arguments are not the path's operations
            inside_launch = any(f.name == "counted_launch" for f in traceback.extract_stack())
            if counting[0] and name not in VIEWS and not inside_launch:
                ops[name] += 1
                if stack:
                    f = stack[-1]
                    where[f"{f.filename.split('gradzip/')[-1]}:{f.lineno} {name}"] += 1
            return func(*args, **(kwargs or {}))

    gpu._launch = counted_launch
    count_on_comm_thread(Count, "29561")
    model = nn.Sequential(*[m for _ in range(24) for m in (nn.Linear(256, 256), nn.LayerNorm(256))])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    codec, opts = parse_spec(spec)
    opts = {"fusion_mb": 1, **opts}
    state = gradzip.register(ddp, codec, **opts)
    x = torch.randn(8, 256)
    for _ in range(3):
        ddp(x).square().mean().backward()
    launches.clear()
    counting[0] = True
    ddp(x).square().mean().backward()
    state.comm.flush()
    counting[0] = False
    groups = len(state.fusion_plan.groups)  # every group is exchanged once a step
    total = sum(ops.values())
    print(f"{spec}: {total} torch operations a step, {total / groups:.1f} a group ({groups} groups); "
          f"Triton launches {dict(launches)}")
    for line, count in where.most_common():
        print(f"  {count:4d}  {line}")
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "maxmin:bits=4")
