"""``gradzip doctor``: what gradzip will use on this machine, and why not something faster.

One place to look before a run or in a bug report: torch and its build, the distributed backends,
which kernels run (and the reason a faster version does not), whether the C kernels build and
where they are cached, Triton, and whether the emulated cluster can run. It only checks (it
creates no namespace) and always exits 0; rich makes it prettier when installed.
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

Row = Tuple[str, str, str]  # (label, value, "ok" | "no" | "info")
Section = Tuple[str, List[Row]]


def _ok(flag: bool) -> str:
    return "ok" if flag else "no"


def _first_line(cmd: List[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def _torch() -> Section:
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU only"
    rows: List[Row] = [
        ("python", f"{platform.python_version()} ({sys.executable})", "info"),
        ("torch", f"{torch.__version__} ({build} build)", "info"),
    ]
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        rows.append(("GPUs", f"{torch.cuda.device_count()} × {', '.join(names)}", "ok"))
    else:
        rows.append(("GPUs", "none visible", "info"))
    rows.append(("torch.distributed", "available" if dist.is_available() else "not built in", _ok(dist.is_available())))
    if dist.is_available():
        backends = (("gloo", dist.is_gloo_available), ("nccl", dist.is_nccl_available), ("mpi", dist.is_mpi_available))
        for name, check in backends:
            found = bool(check())
            status = _ok(found) if name == "gloo" else "info"  # gloo is what CPU training and the tests use
            rows.append((f"backend {name}", "available" if found else "not available", status))
    return "torch", rows


def _gradzip() -> Section:
    import gradzip

    settings = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("GRADZIP_"))
    return "gradzip", [
        ("version", f"{gradzip.__version__} ({os.path.dirname(gradzip.__file__)})", "info"),
        ("GRADZIP_* set", ", ".join(settings) or "none", "info"),
        ("codecs", f"{len(gradzip.codecs.names())} registered (gradzip.codecs.names())", "info"),
    ]


def _kernels() -> Section:
    from ..kernels import active, native

    try:
        act = active()
    except ValueError as exc:  # a bad GRADZIP_KERNELS
        return "kernels", [("GRADZIP_KERNELS", str(exc), "no")]
    import torch

    best = {"cpu": "native", "cuda": "triton"}
    has_gpu = torch.cuda.is_available()
    rows: List[Row] = [("setting", f"GRADZIP_KERNELS={act['setting']}", "info")]
    for device in ("cpu", "cuda"):
        why = act[f"{device}_why"]
        value = act[device] + (f" (not {best[device]}: {why})" if why else "")
        status = "ok" if act[device] == best[device] else "no" if device == "cpu" or has_gpu else "info"
        rows.append((f"{device.upper()} tensors", value, status))
    cc = native._compiler()
    version = _first_line([cc, "--version"]) if cc else ""
    found = f"{shutil.which(cc)} ({version})" if cc else "none found (set CC, or install gcc)"
    rows.append(("C compiler", found, _ok(bool(cc))))
    why = native.available()
    rows.append(("native build", "works" if why is None else why, _ok(why is None)))
    cache = os.environ.get("GRADZIP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gradzip")
    built = sorted(f for f in os.listdir(cache) if f.endswith(".so")) if os.path.isdir(cache) else []
    rows.append(("kernel cache", f"{cache} ({len(built)} built)", "info"))
    return "kernels", rows


def _triton() -> Section:
    try:
        import triton
    except ImportError as exc:
        return "triton", [("triton", f"not importable ({exc}); pip install 'gradzip[gpu]'", "info")]
    from ..kernels.fused import _gpu

    import torch

    gpu = _gpu()
    why = gpu.available() if gpu is not None else "gradzip's Triton kernels failed to import"
    return "triton", [
        ("triton", f"{triton.__version__} importable", "ok"),
        ("Triton kernels", why or "can run", _ok(why is None) if torch.cuda.is_available() else "info"),
    ]


def _cluster() -> Section:
    from ..bench.cluster import available

    root = hasattr(os, "geteuid") and os.geteuid() == 0
    rows: List[Row] = [("root", "yes" if root else "no", _ok(root))]
    for tool in ("ip", "tc"):
        path = shutil.which(tool)
        rows.append((tool, path or "not found (install iproute2)", _ok(path is not None)))
    why = available()
    rows.append(("emulated cluster", "can run (--rate)" if why is None else f"cannot run: {why}", _ok(why is None)))
    return "emulated cluster", rows


def collect() -> List[Section]:
    """Every section; a check that fails unexpectedly becomes a row saying so."""
    sections: List[Section] = []
    for check in (_torch, _gradzip, _kernels, _triton, _cluster):
        try:
            sections.append(check())
        except Exception as exc:  # a doctor reports; it does not crash
            sections.append((check.__name__.strip("_"), [("error", f"{type(exc).__name__}: {exc}", "no")]))
    return sections


_MARK = {"ok": "✓", "no": "✗", "info": " "}


def plain(sections: List[Section]) -> str:
    width = max(len(label) for _, rows in sections for label, _, _ in rows)
    lines = []
    for title, rows in sections:
        lines.append(f"{title}")
        lines += [f"  {_MARK[status]} {label:<{width}}  {value}" for label, value, status in rows]
    return "\n".join(lines)


def render(sections: List[Section], console: Optional[object] = None) -> None:
    """Print with rich when it is installed, as plain text otherwise."""
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        print(plain(sections))
        return
    console = console or Console()  # a pipe gets 80 columns, or $COLUMNS
    colour = {"ok": "green", "no": "red", "info": "dim"}
    table = Table(title="gradzip doctor", show_header=False)
    table.add_column("section", style="bold", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("value")
    for title, rows in sections:
        table.add_section()
        for i, (label, value, status) in enumerate(rows):
            mark = f"[{colour[status]}]{_MARK[status]}[/{colour[status]}]"
            table.add_row(escape(title) if i == 0 else "", mark, escape(label), escape(value))
    console.print(table)


def main() -> int:
    render(collect())
    return 0
