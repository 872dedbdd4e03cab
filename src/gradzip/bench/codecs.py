"""``gradzip bench codecs``: wire size and encode+decode speed of every codec, on one core.

For each codec (default options unless given as ``name:key=value``) on a float32 gradient of
``numel`` elements shaped like a weight matrix: the payload's bytes per element (measured on the
encoded payload; for multi-round codecs from ``wire_bytes``), and the median encode+decode time
over ``repeats`` runs, next to a same-size memory copy timed in the same run — the roofline a
fused codec would approach (``gradzip bench codecs --plot`` draws it as a line).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

import gradzip

from . import write_json
from .micro import parse_spec


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(specs: Sequence[str] = (), numel: int = 1 << 20, repeats: int = 5, threads: int = 1) -> Dict[str, Any]:
    """Measure every codec in ``specs`` (default: all registered, default options)."""
    specs = list(specs) or gradzip.codecs.names()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cols = 1024 if numel % 1024 == 0 else 1
        shape = (numel // cols, cols)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        out = torch.empty_like(x)  # preallocated: a copy into fresh memory would time page faults
        copy_s = _median_time(lambda: out.copy_(x), repeats)
        rows: List[Dict[str, Any]] = []
        for spec in specs:
            name, opts = parse_spec(spec)
            codec = gradzip.codec(name, **opts)
            payload = codec.encode(x, name="w")
            multi_round = type(codec).next_round is not gradzip.Codec.next_round
            wire = codec.wire_bytes(numel, x.dtype, shape=shape) if multi_round else payload.nbytes
            seconds = _median_time(lambda: codec.decode(codec.encode(x, name="w")), repeats)
            rows.append({
                "codec": spec,
                "family": codec.family,
                "wire_bytes": wire,
                "bits_per_element": 8 * wire / numel,
                "encode_decode_ms": seconds * 1e3,
                "gbps": 4 * numel / seconds / 1e9,
                "vs_copy": copy_s / seconds,
            })
    finally:
        torch.set_num_threads(before)
    return {
        "numel": numel, "repeats": repeats, "threads": threads,
        "copy_ms": copy_s * 1e3, "copy_gbps": 4 * numel / copy_s / 1e9, "rows": rows,
    }


def run(specs: Sequence[str] = (), numel: int = 1 << 20, repeats: int = 5, threads: int = 1, json_path: Optional[str] = None) -> Dict[str, Any]:
    return write_json(measure(specs, numel, repeats, threads), json_path)


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table."""
    from rich import box
    from rich.table import Table

    t = Table(
        title=f"codecs on {report['numel']:,} fp32 values, {report['threads']} thread(s), median of {report['repeats']}",
        caption=f"memory copy of the same tensor: {report['copy_ms']:.2f} ms; vs copy = copy time / encode+decode time",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    for col in ("codec", "family", "bits/elem", "ratio", "enc+dec ms", "GB/s", "vs copy"):
        t.add_column(col, justify="left" if col in ("codec", "family") else "right", no_wrap=True)
    for r in report["rows"]:
        t.add_row(
            r["codec"], r["family"], f"{r['bits_per_element']:.3f}", f"{32 / r['bits_per_element']:.1f}×",
            f"{r['encode_decode_ms']:.2f}", f"{r['gbps']:.2f}", f"{r['vs_copy']:.2f}",
        )
    return t
