"""``gradzip bench codecs``: wire size and encode+decode speed of every codec, on one core or a GPU.

For each codec (default options unless given as ``name:key=value``) on a float32 gradient of
``numel`` elements shaped like a weight matrix: the payload's bytes per element (measured on the
encoded payload; for multi-round codecs from ``wire_bytes``), and the median encode+decode time
over ``repeats`` runs, next to a same-size memory copy timed in the same run — the roofline a
fused codec would approach (``gradzip bench codecs --plot`` draws it as a line). Decoding is
timed into a preallocated tensor (``decode_into``, what the collectives do), like the copy; the
time with a freshly allocated result, page faults included, is reported beside it. With
``device="cuda"`` the tensors live on the GPU and every timed call ends with a synchronisation
(so a time is the kernels', not their launch's); encode and decode are also given as fractions
of the copy's speed, the share of the memory bandwidth each reaches, both per call and in a
stream (calls queued back to back, one synchronisation: the host's launch work then overlaps
the kernels before it, as in a training step). Encoding, too, writes into preallocated tensors
where the codec gives its payload's form before encoding (``payload_spec``), as the collectives
lend it their message buffers; the others make their payload, as they do in an exchange. So
the table does not time the page faults of fresh memory, which on Linux depend on how
transparent huge pages are set (reported with the results).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

import gradzip
from gradzip.kernels import fused, native

from ..policy.planner import median_seconds
from . import write_json
from .micro import huge_pages, parse_spec


STREAMED = 10  # calls queued back to back per timed run on a GPU (see _stream_time)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    if device.type == "cuda":  # the kernels' time: wait for them inside the timed call
        call = fn

        def fn():
            call()
            torch.cuda.synchronize(device)

    fn()  # warm-up
    return median_seconds(fn, repeats)


def _stream_time(fn, repeats: int, device: torch.device) -> float:
    """Seconds per call with ``STREAMED`` calls queued back to back and one synchronisation:
    the GPU's throughput as a hook issues its work, the host's launch latency hidden behind
    the kernels before it (where the host is the slower, it shows)."""
    def batch():
        for _ in range(STREAMED):
            fn()
        torch.cuda.synchronize(device)

    batch()  # warm-up
    return median_seconds(batch, repeats) / STREAMED


def _kernels(device: torch.device) -> str:
    """Which kernel versions ran: the setting, and why the fused ones did not if they did not."""
    if device.type == "cuda":
        active = fused.active()
        why = active.get("cuda_why")
        return f"{fused.setting()}; {active.get('cuda')} kernels on {torch.cuda.get_device_name(device)}" + (
            "" if why is None else f" ({why})"
        )
    why = native.available()
    return f"{fused.setting()}; fused CPU kernels " + ("built" if why is None else f"unavailable ({why})")


def check_device(device: "str | torch.device") -> torch.device:
    """``device`` as a torch device; ValueError for one this machine cannot run the benchmark on."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be cpu or cuda[:index], got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:index], got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {dev}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def measure(
    specs: Sequence[str] = (), numel: int = 1 << 20, repeats: int = 5, threads: int = 1, device: "str | torch.device" = "cpu",
) -> Dict[str, Any]:
    """Measure every codec in ``specs`` (default: all registered, default options) on ``device``."""
    specs = list(specs) or gradzip.codecs.names()
    dev = check_device(device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cols = 1024 if numel % 1024 == 0 else 1
        shape = (numel // cols, cols)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dev)
        out = torch.empty_like(x)  # preallocated: a copy into fresh memory would time page faults
        copy_s = _median_time(lambda: out.copy_(x), repeats, dev)
        streamed = dev.type == "cuda"
        copy_stream_s = _stream_time(lambda: out.copy_(x), repeats, dev) if streamed else copy_s
        rows: List[Dict[str, Any]] = []
        for spec in specs:
            name, opts = parse_spec(spec)
            codec = gradzip.codec(name, **opts)
            payload = codec.encode(x, name="w")
            multi_round = type(codec).next_round is not gradzip.Codec.next_round
            wire = codec.wire_bytes(numel, x.dtype, shape=shape) if multi_round else payload.nbytes
            flat = out.view(-1)
            form = codec.payload_spec(numel, x.dtype)  # (written where a collective lends its buffers)
            lent = None if form is None else [torch.empty(k, dtype=d, device=dev) for d, k in form]
            encode_s = _median_time(lambda: codec.encode(x, name="w", out=lent), repeats, dev)
            decode_s = _median_time(lambda: codec.decode_into(payload, flat), repeats, dev)
            alloc_s = _median_time(lambda: codec.decode(codec.encode(x, name="w")), repeats, dev)
            seconds = encode_s + decode_s
            stream: Dict[str, Any] = {}
            if streamed:
                enc_stream = _stream_time(lambda: codec.encode(x, name="w", out=lent), repeats, dev)
                dec_stream = _stream_time(lambda: codec.decode_into(payload, flat), repeats, dev)
                stream = {
                    "encode_stream_ms": enc_stream * 1e3, "decode_stream_ms": dec_stream * 1e3,
                    "encode_stream_vs_copy": copy_stream_s / enc_stream,
                    "decode_stream_vs_copy": copy_stream_s / dec_stream,
                }
            rows.append({
                "codec": spec,
                "family": codec.family,
                "wire_bytes": wire,
                "bits_per_element": 8 * wire / numel,
                "encode_into_buffers": lent is not None,
                "encode_ms": encode_s * 1e3,
                "decode_ms": decode_s * 1e3,
                "encode_decode_ms": seconds * 1e3,
                "encode_decode_alloc_ms": alloc_s * 1e3,
                "gbps": 4 * numel / seconds / 1e9,
                "vs_copy": copy_s / seconds,
                "encode_vs_copy": copy_s / encode_s,
                "decode_vs_copy": copy_s / decode_s,
                **stream,
            })
    finally:
        torch.set_num_threads(before)
    return {
        "numel": numel, "repeats": repeats, "threads": threads, "device": str(dev), "kernels": _kernels(dev),
        "huge_pages": huge_pages(),
        "copy_ms": copy_s * 1e3, "copy_gbps": 4 * numel / copy_s / 1e9, "rows": rows,
        **({"copy_stream_ms": copy_stream_s * 1e3, "streamed": STREAMED} if streamed else {}),
    }


def run(
    specs: Sequence[str] = (), numel: int = 1 << 20, repeats: int = 5, threads: int = 1, json_path: Optional[str] = None,
    device: "str | torch.device" = "cpu",
) -> Dict[str, Any]:
    return write_json(measure(specs, numel, repeats, threads, device), json_path)


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table (plain text without rich)."""
    from .tables import table as new_table

    t = new_table(
        title=(
            f"codecs on {report['numel']:,} fp32 values, "
            + (f"{report['threads']} thread(s)" if report.get("device", "cpu") == "cpu" else report["device"])
            + f", median of {report['repeats']}"
        ),
        caption=(
            f"memory copy of the same tensor into a preallocated one: {report['copy_ms']:.2f} ms; decode writes into a "
            "preallocated tensor too, as the collectives do; vs copy = copy time / (encode + decode); "
            "encode writes into preallocated tensors where the codec gives its payload's form first (enc into: "
            "buffers), as the collectives lend them, else makes its payload (new); "
            "enc/dec vs copy: copy time / encode (decode) time; "
            f"enc+new dec: decode into a fresh tensor (page faults included); kernels: {report.get('kernels', '-')}; "
            f"transparent huge pages: {report.get('huge_pages', '-')}"
        ),
    )
    streamed = "copy_stream_ms" in report
    if streamed:
        t.caption += (
            f"; in a stream: {report['streamed']} calls queued back to back, one synchronisation "
            f"(copy {report['copy_stream_ms']:.2f} ms), the kernels' throughput as a hook issues them"
        )
    cols = ("codec", "family", "bits/elem", "ratio", "enc into", "enc ms", "dec ms", "GB/s", "vs copy", "enc vs copy",
            "dec vs copy", "enc+new dec ms")
    if streamed:
        cols += ("enc vs copy in a stream", "dec vs copy in a stream")
    for col in cols:
        t.add_column(col, justify="left" if col in ("codec", "family") else "right", no_wrap=True)
    for r in report["rows"]:
        t.add_row(
            r["codec"], r["family"], f"{r['bits_per_element']:.3f}", f"{32 / r['bits_per_element']:.1f}×",
            {True: "buffers", False: "new"}.get(r.get("encode_into_buffers"), "-"), f"{r['encode_ms']:.2f}", f"{r['decode_ms']:.2f}", f"{r['gbps']:.2f}", f"{r['vs_copy']:.2f}",
            *(f"{r[k]:.0%}" if k in r else "-" for k in ("encode_vs_copy", "decode_vs_copy")),
            f"{r['encode_decode_alloc_ms']:.2f}",
            *((f"{r['encode_stream_vs_copy']:.0%}", f"{r['decode_stream_vs_copy']:.0%}") if streamed else ()),
        )
    return t
