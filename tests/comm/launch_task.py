"""A task module for tests/comm/test_launch.py: it reads the environment when it is imported,
as a rank unpickles its task."""
from __future__ import annotations

import os
import sys
import time

AT_IMPORT = os.environ.get("LAUNCH_TEST_MARKER")


def where(rank: int, world: int) -> dict:
    preloaded = "torch._dynamo" in sys.modules  # (what DistributedDataParallel's constructor imports)
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"parent": os.getppid(), "marker": os.environ.get("LAUNCH_TEST_MARKER"), "at_import": AT_IMPORT,
            "seed": torch.initial_seed(), "threads": torch.get_num_threads(), "sum": total.item(),
            "path": sys.path[:], "preloaded": preloaded}


def sleep_and_say_where(rank: int, world: int, folder: str) -> None:
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":  # a launcher to be killed: python -m tests.comm.launch_task FOLDER
    from gradzip.comm.launch import spawn_local

    spawn_local(sleep_and_say_where, 2, sys.argv[1])
