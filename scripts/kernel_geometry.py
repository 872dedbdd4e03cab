"""Time gradzip's Triton max-min and QSGD kernels on a CUDA device across tile geometries.

A program of the bucketed kernels holds ROWS buckets of BLOCK values with ``num_warps`` warps
(``gradzip.kernels.gpu._geometry``). The geometry changes how the work is spread, never the
bytes: every variant's output is checked bit for bit against the default's. Prints one line per
variant (encode and decode time, as fractions of a device copy of the input) and the best.

    PYTHONPATH=src python scripts/kernel_geometry.py [--numel N] [--bits 4] [--bucket 1024]
"""
from __future__ import annotations

import argparse
import itertools

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=1024)
    args = ap.parse_args()
    import triton.testing

    from gradzip.kernels import gpu

    gpu._require()
    x = torch.randn(args.numel, device="cuda")
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    default = gpu._geometry
    rows0, block, chunked, warps0 = default(args.bucket)
    ref = {}
    rows_out = []
    for name in ("maxmin", "qsgd"):
        enc = getattr(gpu, f"{name}_encode")
        dec = getattr(gpu, f"{name}_decode")
        key = 7 if name == "qsgd" else None
        base = enc(x, args.bits, args.bucket, key)
        ref[name] = (base, dec(*base, args.bits, args.bucket, args.numel))
        for rows, warps in itertools.product((1, 2, 4), (4, 8, 16)):
            gpu._geometry = lambda bucket, r=rows, w=warps: (r, block, chunked, w)
            try:
                got = enc(x, args.bits, args.bucket, key)
                out = torch.empty_like(x)
                dec(*got, args.bits, args.bucket, args.numel, out)
                same = all(torch.equal(a, b) for a, b in zip(got, base)) and torch.equal(out, ref[name][1])
                e = triton.testing.do_bench(lambda: enc(x, args.bits, args.bucket, key), return_mode="median")
                d = triton.testing.do_bench(lambda: dec(*got, args.bits, args.bucket, args.numel, out), return_mode="median")
            except Exception as exc:  # a geometry the compiler refuses (too many registers)
                print(f"{name} rows={rows} warps={warps}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                continue
            finally:
                gpu._geometry = default
            mark = " (default)" if (rows, warps) == (rows0, warps0) else ""
            rows_out.append((name, rows, warps, e, d, same))
            print(f"{name} rows={rows} warps={warps}{mark}: encode {e * 1e3:.0f} us = {copy_ms / e:.0%} of copy, "
                  f"decode {d * 1e3:.0f} us = {copy_ms / d:.0%}, bit-identical {same}")
    for name in ("maxmin", "qsgd"):
        mine = [r for r in rows_out if r[0] == name and r[5]]
        if mine:
            e = min(mine, key=lambda r: r[3])
            d = min(mine, key=lambda r: r[4])
            print(f"best {name}: encode rows={e[1]} warps={e[2]} {copy_ms / e[3]:.0%}; decode rows={d[1]} warps={d[2]} {copy_ms / d[4]:.0%}")
    print(f"copy of {args.numel} fp32 values: {copy_ms * 1e3:.0f} us")


if __name__ == "__main__":
    main()
