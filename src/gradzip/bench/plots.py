"""PNG plots of the benchmark reports, drawn from the JSON-ready report dicts alone.

They take the report (not the raw measurements), so a saved JSON can be plotted again later.
matplotlib is an optional extra (``bench``, ``demo``): it is imported inside the functions, with
the Agg backend, so the benchmarks run and print without it and no display is needed.
"""
from __future__ import annotations

from typing import Any, Dict, List


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(method: str) -> str:
    """``"maxmin:bits=2"`` → ``"maxmin bits=2"``, as in the table."""
    return " ".join(method.split(":"))


def allreduce(report: Dict[str, Any], path: str) -> None:
    """Time and bus bandwidth against size, a line per method, on log-log axes.

    Each method's wire limit (when the link rate is known) is a dashed line of its colour and its
    codec limit a dotted one, so the plot shows which limit a method runs into as sizes grow.
    Every method has its own marker; fp32, the baseline, is drawn last as a thick translucent black
    line, so a method that measures the same stays visible under it.
    """
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    methods: Dict[str, List[Dict[str, Any]]] = {}
    for r in report["rows"]:
        methods.setdefault(r["method"], []).append(r)
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    markers = iter("osD^vP<>X" * 4)
    for method, rows in sorted(methods.items(), key=lambda m: m[0] == "fp32"):  # the baseline last, on top
        rows = sorted(rows, key=lambda r: r["size_mb"])
        sizes = [r["size_mb"] for r in rows]
        style = (dict(color="black", linewidth=3, alpha=0.45, marker="*", markersize=9, zorder=10)
                 if method == "fp32" else dict(marker=next(markers), zorder=3))
        (line,) = ax_time.plot(sizes, [r["median_s"] for r in rows], label=_label(method), **style)
        style.pop("color", None)
        color = line.get_color()
        wire = [(r["size_mb"], r["wire_limit_s"]) for r in rows if r.get("wire_limit_s")]
        if wire:
            ax_time.plot(*zip(*wire), linestyle="--", color=color, linewidth=1)
        codec = [(r["size_mb"], r["codec_limit_s"]) for r in rows if r.get("codec_limit_s")]
        if codec:
            ax_time.plot(*zip(*codec), linestyle=":", color=color, linewidth=1)
        ax_bw.plot(sizes, [r["busbw_gbps"] for r in rows], color=color, label=_label(method), **style)
    ax_time.set(xscale="log", yscale="log", xlabel="tensor size (MiB)", ylabel="time per all-reduce (s, median)",
                title="Time (dashed: wire limit, dotted: codec limit)")
    ax_bw.set(xscale="log", xlabel="tensor size (MiB)", ylabel="bus bandwidth (GB/s, uncompressed bytes)",
              title="Bus bandwidth: 2(W−1)/W · bytes / time")
    sizes = sorted({r["size_mb"] for r in report["rows"]})
    for ax in (ax_time, ax_bw):
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])  # the measured sizes, not powers of ten
        ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)  # the limits share their method's colour, so only methods are listed
    fig.suptitle(
        f"all-reduce over {report['workers']} gloo ranks, {report['network']}, median of {report['repeats']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fraction(x: float) -> str:
    return f"{100 * x:.3g}% of copy"


def codecs(report: Dict[str, Any], path: str) -> None:
    """Encode+decode GB/s per codec as bars, against the memory copy timed in the same run.

    The copy is the roofline: a codec reads its input at least once, so a fused one could at best
    approach copy speed. Each bar is labelled with its fraction of it.
    """
    plt = _pyplot()
    rows = report["rows"]
    copy_gbps = report["copy_gbps"]
    names = [r["codec"] for r in rows]
    speeds = [r["gbps"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.8))
    ax.barh(names, speeds, color="tab:blue")
    ax.axvline(copy_gbps, color="tab:red", linestyle="--", label=f"memory copy: {copy_gbps:.2f} GB/s")
    for y, r in enumerate(rows):
        ax.annotate(_fraction(r["vs_copy"]), (r["gbps"], y), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)
    values = speeds + [copy_gbps]
    log = max(values) > 30 * min(values)  # slow codecs would be invisible on a linear axis
    if log:
        ax.set_xscale("log")
    ax.set_xlim(right=max(values) * (3 if log else 1.35))  # room for the labels
    ax.invert_yaxis()  # first codec on top, as in the table
    ax.set(xlabel="encode+decode throughput (GB/s of fp32 input)",
           title=f"codecs on {report['numel']:,} fp32 values, {report['threads']} thread(s), median of {report['repeats']}")
    ax.grid(alpha=0.3, axis="x", which="both")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def models(report: Dict[str, Any], path: str) -> None:
    """Time per step per method, one panel per model, each bar against its own limits.

    A bar is the median step (whisker: min–max); on it a dashed tick marks the method's wire
    limit and a dotted one its codec limit, so the distance to the physical floor shows; the grey
    line is the model's forward+backward without communication. Labels give the speed-up over
    fp32 DDP.
    """
    plt = _pyplot()
    from matplotlib.lines import Line2D

    entries = report["models"]
    cols = min(2, len(entries))
    rows = -(-len(entries) // cols)
    n_methods = max(len(m["rows"]) for m in entries)
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, (0.45 * n_methods + 1.6) * rows), squeeze=False)
    for ax, model in zip(axes.flat, entries):
        rs = model["rows"]
        ys = range(len(rs))
        med = [r["median_s"] for r in rs]
        err = [[r["median_s"] - r["min_s"] for r in rs], [r["max_s"] - r["median_s"] for r in rs]]
        colors = [f"C{i}" for i in ys]
        ax.barh(list(ys), med, xerr=err, color=colors, alpha=0.8, capsize=3)
        for y, r in zip(ys, rs):
            if r.get("wire_limit_s"):
                ax.plot([r["wire_limit_s"]] * 2, [y - 0.4, y + 0.4], color="black", linestyle="--", linewidth=1.2)
            if r.get("codec_limit_s"):
                ax.plot([r["codec_limit_s"]] * 2, [y - 0.4, y + 0.4], color="tab:red", linestyle=":", linewidth=1.5)
            note = f"{r['median_s']:.2f} s" + (f", {r['vs_fp32']:.2f}× fp32" if r.get("vs_fp32") else "")
            ax.annotate(note, (r["max_s"], y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
        ax.axvline(model["compute_s"], color="grey", linewidth=1)
        ax.set_yticks(list(ys), [_label(r["method"]) for r in rs])
        ax.invert_yaxis()  # fp32 on top, as in the table
        ax.set_xlim(0, max(r["max_s"] for r in rs) * 1.45)  # room for the labels
        kind = "real forward/backward" if model.get("real_compute") else "gradient set only"
        ax.set_title(f"{model['title']}: {model['tensors']} tensors, {model['numel'] / 1e6:.1f} M values, "
                     f"{model.get('buckets', '?')} buckets ({kind})", fontsize=9)
        ax.set_xlabel("seconds per step (median; whisker: min–max)")
        ax.grid(alpha=0.3, axis="x")
    for ax in list(axes.flat)[len(entries):]:
        ax.axis("off")
    handles = [
        Line2D([], [], color="black", linestyle="--", label="wire limit"),
        Line2D([], [], color="tab:red", linestyle=":", label="codec limit"),
        Line2D([], [], color="grey", label="forward+backward, no communication"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(  # two lines: a single panel is narrow
        f"DDP step per model and method, {report['workers']} gloo ranks, median of {report['steps']}\n{report['network']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
