"""Host time of one bucket's job on the accelerator path, without a GPU: the engine's device
choices switched to their CUDA branches (as in ``gpu_path_ops.py``) and the Triton launches
left out, so what is timed is the comm thread's own work per job: Python, torch's dispatch and
views, the small operations on tiny tensors. The bucket is ResNet-like: 53 compressed weights
each followed by two uncompressed 64-value norms (and two more), one rank over gloo.

    python scripts/gpu_path_host.py [memory] [codec]   (memory: none, the default, or residual;
                                                        codec: maxmin:bits=4, the default, or a spec)

On a GPU that time is paid per group on the comm thread, and the last group of a step is issued
only after backward has ended (docs/gpu.md).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_path_ops  # noqa: E402  (puts src on the path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gradzip  # noqa: E402
from gradzip.kernels import gpu  # noqa: E402
from gradzip.sync.engine import Batch  # noqa: E402
from gradzip.sync.pipeline import drive  # noqa: E402


def main(memory: str, spec: str = "maxmin:bits=4", jobs: int = 100) -> None:
    gpu_path_ops.accelerator_choices()
    gpu._launch = lambda kernel, grid, device, *args, **meta: None  # the kernels' own time is not the point
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    from gradzip.bench.micro import parse_spec

    name, options = parse_spec(spec)
    comm = gradzip.Communicator(name, **{"memory": None if memory == "default" else memory, **options})
    shapes = [s for _ in range(53) for s in ((16, 16, 3, 3), (64,), (64,))] + [(64,)] * 2
    buffer = torch.randn(sum(torch.Size(s).numel() for s in shapes))
    views, offset = [], 0
    for s in shapes:  # DDP's gradients: views of its bucket, back to back
        n = torch.Size(s).numel()
        views.append(buffer[offset : offset + n].view(s))
        offset += n
    plain = [i for i, s in enumerate(shapes) if len(s) == 1]
    comp = [i for i, s in enumerate(shapes) if len(s) > 1]
    tensors = [views[i] for i in plain + comp]
    names = [f"p{i:03d}" for i in plain + comp]
    compress = [False] * len(plain) + [True] * len(comp)
    groups = [list(range(len(plain), len(tensors)))]

    def job(step: int) -> None:
        drive(comm.batch_stages(Batch(tensors, names, compress, groups=groups, buffer=buffer), step))

    for step in range(5):
        job(step)
    start = time.perf_counter()
    for step in range(5, 5 + jobs):
        job(step)
    seconds = (time.perf_counter() - start) / jobs
    print(f"{spec} memory={memory}: {seconds * 1e3:.2f} ms of host time a job ({len(comp)} compressed, "
          f"{len(plain)} plain gradients)")
    comm.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none", sys.argv[2] if len(sys.argv) > 2 else "maxmin:bits=4")
