"""Compile gradzip's Triton kernels for a CUDA GPU on a machine without one.

Each public kernel function of ``gradzip/kernels/gpu.py`` is called on small CPU tensors in the
configurations gradzip uses (bit widths, bucket geometries, dtypes, flags), and each launch is
compiled (Triton's front end, its CUDA back end and ptxas, for sm_90 by default) instead of run.
Triton's interpreter, which runs the kernels in the tests on a CPU, accepts programs that
compiled Triton rejects (a function that returns a scalar in one branch and a vector in the
other, for one), so this is the check that a kernel builds before it meets a GPU.

    python scripts/compile_kernels.py [--arch 90] [--quick]

Prints each kernel's variants and exits non-zero if one fails to compile. ``--quick`` takes
fewer bit widths and geometries (the suite's test).
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import traceback

os.environ["TRITON_INTERPRET"] = "0"  # (before Triton is imported: its language compiled, not interpreted)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1",
}


class Compiler:
    """Stands in for ``gpu._launch``: compiles each distinct launch once and records failures."""

    def __init__(self, arch: int) -> None:
        import triton
        from triton.backends.compiler import GPUTarget

        self.triton, self.target = triton, GPUTarget("cuda", arch, 32)
        self.done: dict = {}
        self.failed: list = []

    def __call__(self, kernel, grid, device, *args, **meta) -> None:
        from triton.compiler import ASTSource

        names = list(inspect.signature(kernel.fn).parameters)
        options = {"enable_fp_fusion": False, "num_warps": meta.pop("num_warps", 4)}
        signature, constexprs = {}, {}
        for name, value in zip(names, args):
            if isinstance(value, torch.Tensor):
                signature[name] = "*" + DTYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        for name in names[len(args):]:
            signature[name] = "constexpr"
            constexprs[(names.index(name),)] = meta[name]
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())), options["num_warps"])
        if key in self.done:
            return
        start = time.perf_counter()
        try:
            self.triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=self.target,
                                options=options)
            self.done[key] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001  (every failure is reported)
            self.done[key] = None
            cause = exc.__cause__ or exc
            self.failed.append((kernel.fn.__name__, dict(signature), dict(meta), f"{type(cause).__name__}: {cause}"))


def prepare(arch: int) -> Compiler:
    """The kernels decorated for compilation, and ``_launch`` compiling instead of running."""
    import triton
    import triton.language as tl

    from gradzip.kernels import gpu

    gpu.triton, gpu.tl = triton, tl
    for name in gpu._JIT:
        setattr(gpu, name, triton.jit(getattr(gpu, name)))
    gpu._loaded, gpu._error, gpu._interpreted = True, None, False
    compiler = Compiler(arch)
    gpu._launch = compiler
    return compiler


def launch_everything(quick: bool) -> None:
    """Every public kernel function in the configurations the codecs use."""
    from gradzip.kernels import gpu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6000, generator=g)
    bit_widths = (1, 3, 8) if quick else range(1, 9)
    buckets = (64, 5000) if quick else (8, 64, 512, 1024, 5000)
    dtypes = (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for dtype in dtypes:
        xd = x.to(dtype)
        for bits in bit_widths:
            for bucket in buckets:
                for key in (None, 7) if dtype == torch.float32 else (7,):
                    packed, stats = gpu.maxmin_encode(xd, bits, bucket, key)
                for accumulate in (False, True) if dtype == torch.float32 else ():
                    gpu.maxmin_decode(packed, stats, bits, bucket, 6000, torch.zeros(6000), accumulate)
                packed, norms = gpu.qsgd_encode(xd, bits, bucket, 7)
                for accumulate in (False, True) if dtype == torch.float32 else ():
                    gpu.qsgd_decode(packed, norms, bits, bucket, 6000, torch.zeros(6000), accumulate)
        bits_ = gpu.sign_encode(xd)
        gpu.tbq_encode(xd, 0.01)
        gpu.select_magnitudes(xd, 0.5)
        gpu.select_magnitudes(xd, thresholds=torch.full((24,), 0.5), valid=torch.full((24,), 256, dtype=torch.int32))
        tags, stream = gpu.inceptionn_encode(xd, 2.0**-10, 2.0**-9)
        for accumulate in (False, True):
            gpu.inceptionn_decode(tags, stream, dtype, 6000, 2.0**-9, torch.zeros(6000), accumulate)
        for fmt in ("e4m3", "e5m2"):
            gpu.fp8_encode(xd, fmt, 128)
        for elem in ("e4m3", "e2m1"):
            gpu.mx_encode(xd, elem, 32)
        if dtype != torch.float64:
            gpu.topk(xd, 60)
    for accumulate in (False, True):
        out = torch.zeros(6000)
        gpu.sign_decode(bits_, 6000, None, out, accumulate)
        gpu.sign_decode(bits_, 6000, torch.ones(1), out, accumulate)
        for fmt in ("e4m3", "e5m2"):
            codes, scales = gpu.fp8_encode(x, fmt, 128)
            gpu.fp8_decode(codes, scales, fmt, 128, 6000, out, accumulate)
        for elem in ("e4m3", "e2m1"):
            codes, scales = gpu.mx_encode(x, elem, 32)
            gpu.mx_decode(codes, scales, elem, 32, 6000, out, accumulate)
    for dtype in (torch.float16, torch.bfloat16):
        gpu.saturate(x, dtype)
    gpu.counter_uniform(6000, 7, torch.device("cpu"))
    rows = x[:5120].view(-1, 256)
    packed, scale = gpu.terngrad_encode(rows, 7, rows.numel())
    gpu.terngrad_encode(rows, 7, rows.numel(), scale * 2)
    top = torch.tensor([130], dtype=torch.int32)
    tops = torch.full((24,), 130, dtype=torch.int32)
    codes = gpu.natural_codes(x.view(torch.int32), 7, top)
    gpu.natural_codes(x.view(torch.int32), 7, tops, 256)
    inv, mids, lut = torch.ones(24), torch.zeros(256), torch.zeros(65536, dtype=torch.uint8)
    u8 = gpu.u8bit_codes(x.view(-1, 250), inv, mids, lut, 6000)
    for accumulate in (False, True):
        out = torch.zeros(6000)
        gpu.ternary_decode(packed, scale, 256, rows.numel(), out[: rows.numel()], accumulate)
        gpu.natural_decode(codes, top, 0, 6000, out, accumulate)
        gpu.natural_decode(codes, tops, 256, 6000, out, accumulate)
        gpu.table_decode(u8, torch.zeros(256), None, 250, 6000, out, accumulate)
        gpu.table_decode(u8, torch.zeros(256), torch.ones(24), 250, 6000, out, accumulate)
        gpu.onebit_decode(bits_, torch.zeros(48), 256, 6000, out, accumulate)
    for block in (x.view(1, -1), x.view(-1, 250), x[:5120].view(-1, 256), torch.randn(1, 200_000, generator=g)):
        gpu.row_maxima(block)
        gpu.side_sums(block)
    for finite in (True, False):
        gpu.signum_encode(x, torch.zeros(6000), 0.9, torch.tensor(finite))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, e.g. 80, 90 (default 90)")
    parser.add_argument("--quick", action="store_true", help="fewer bit widths and bucket geometries")
    args = parser.parse_args()
    compiler = prepare(args.arch)
    start = time.perf_counter()
    try:
        launch_everything(args.quick)
    except Exception:  # noqa: BLE001  (a host-side failure before a launch)
        traceback.print_exc()
        return 2
    from gradzip.kernels import gpu

    kernels: dict = {}
    for key in compiler.done:
        kernels[key[0]] = kernels.get(key[0], 0) + 1
    for name, count in sorted(kernels.items()):
        print(f"{name}: {count} variant{'s' if count > 1 else ''}")
    # every kernel of the module launched here (the interpreter's probe aside)
    missing = sorted(n for n in gpu._JIT if n.endswith("_kernel") and n != "_interpreter_probe_kernel" and n not in kernels)
    print(f"{len(compiler.done)} variants of {len(kernels)} kernels for sm_{args.arch} in "
          f"{time.perf_counter() - start:.1f} s; {len(compiler.failed)} failed; not launched: {missing or 'none'}")
    for name, signature, meta, error in compiler.failed:
        print(f"FAILED {name} {signature} {meta}:\n  {error}")
    return 1 if compiler.failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
