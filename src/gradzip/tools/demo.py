"""``gradzip demo``: data-parallel training of a small MLP with every codec, side by side.

The job trains a 64→width→width→10 MLP on scikit-learn's bundled digits (no download) on W local
gloo ranks wrapped in ``DistributedDataParallel``, once per configuration, all in one spawn so
process start-up is paid once. Every configuration starts from the same seed and sees the same
batches, so the only difference between rows is how gradients cross the wire. ``bucket_cap_mb``
gives DDP several buckets, the case where ordering bugs between ranks show.

``gradzip demo`` runs on an emulated 100 Mbit/s cluster (:mod:`gradzip.bench.cluster`) where root
and iproute2 allow. On loopback the wire is free, so compression cannot win there: the output
says so first, and puts beside every measured time what the same bytes would need on such a
link (payload bytes per rank × the collective's pattern / link rate, :func:`link_seconds`).

Each rank reports, per configuration: test accuracy after every epoch, training loss per step
(averaged over ranks), bytes it put on the wire, wall time, and whether all ranks ended with
bit-identical parameters (they must: gradzip decodes on every rank what was sent). Rank 0 hands
the results to the parent process, which prints a table and writes JSON and a plot.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..bench import cluster
from ..bench.digits import load_digits_split, make_model
from ..bench.methods import CONFIGS, OPTIMIZER_OVERRIDES, attach, describe
from ..comm.launch import spawn_local

# Configs run in a spawn of their own with a short collective timeout, so that a failure (or a
# hang: PyTorch's PowerSGD hook issues all-reduces from Future callbacks, which with several
# buckets in flight can reach gloo in a different order on each rank) is recorded, not fatal.
ISOLATED = {"torch-powersgd"}
ISOLATED_TIMEOUT_S = 60  # one collective
ISOLATED_DEADLINE_S = 180  # the whole config
# DDP's bucket cap is the model's gradient size over this, so every width has several buckets in
# flight (the case where ordering bugs between ranks show) and none pays per-bucket costs often.
BUCKETS = 6
DEFAULT_CONFIGS = ["fp32", "torch-fp16", "maxmin4", "maxmin2", "topk"]

# run_demo's defaults: a 256-wide MLP on loopback, 8 epochs, fp32 reaches ≥ 95% test accuracy
# (≈97%); every rank gets batch_size / workers samples per step.
DEFAULTS = dict(workers=4, epochs=8, batch_size=64, lr=0.05, momentum=0.9, seed=0, width=256, rate=None, ranks_per_node=1)
# ``gradzip demo``'s defaults: an emulated cluster with 100 Mbit/s links and a model whose gradients
# (4.5 MB a step, 1.1 M parameters) make the link matter; small batches, so a step is mostly
# communication. Two epochs (88 steps) of the five default configs take 2–3.5 minutes on 2 cores.
# At 1 Gbit/s the same job is CPU-bound here (4 ranks share 2 cores; the codec's CPU work per
# step is about the wire time it saves), so the win shows only on the slower link.
COMMAND_DEFAULTS = {**DEFAULTS, "epochs": 2, "batch_size": 32, "width": 1024, "rate": "100mbit"}
# ``--rate`` values that mean plain loopback
LOOPBACK = ("loopback", "none", "off")
# The link that loopback runs estimate their wire time on: the command's default one.
REFERENCE_RATE = COMMAND_DEFAULTS["rate"]


class _Lines:
    """Rank 0's progress without rich: a line per config when it ends."""

    def __init__(self) -> None:
        self.started: Dict[str, float] = {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def start_task(self, task: str) -> None:
        self.started[task] = time.perf_counter()

    def advance(self, task: str) -> None:
        pass

    def finish(self, task: str) -> None:
        print(f"{task:>10}: {time.perf_counter() - self.started[task]:.1f} s", flush=True)


def _progress(rank: int, names: Sequence[str], total: int):
    """Rank 0's progress bar (one task per config; a line per config without rich); others get None."""
    if rank != 0:
        return None, {}
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:
        return _Lines(), {n: n for n in names}

    bar = Progress(TextColumn("{task.description:>10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return bar, {n: bar.add_task(n, total=total, start=False) for n in names}  # clock starts with the config


def _identical(model: nn.Module) -> bool:
    """Do all ranks hold bit-identical parameters? (all-gather of the flattened parameters)"""
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _train_one(name: str, data, opts: Dict[str, Any], rank: int, world: int, bar, task) -> Dict[str, Any]:
    """Train one configuration from scratch; every rank returns the same record."""
    x_tr, y_tr, x_te, y_te = data
    model = make_model(opts["seed"], opts["width"])
    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = DistributedDataParallel(model, bucket_cap_mb=grad_mb / BUCKETS)
    spec = CONFIGS[name]
    state = attach(ddp, name)
    sgd = {"lr": opts["lr"], "momentum": opts["momentum"], **OPTIMIZER_OVERRIDES.get(name, {})}
    optim = torch.optim.SGD(ddp.parameters(), **sgd)
    loss_fn = nn.CrossEntropyLoss()

    batch = opts["batch_size"]
    steps_per_epoch = x_tr.shape[0] // batch  # drop the last partial batch: equal steps on every rank
    losses = torch.zeros(opts["epochs"] * steps_per_epoch)
    elapsed = torch.zeros(opts["epochs"] * steps_per_epoch, dtype=torch.float64)
    accuracy: List[float] = []
    epoch_end_s: List[float] = []
    step = 0
    dist.barrier()
    if bar is not None:
        bar.start_task(task)
    start = time.perf_counter()
    for epoch in range(opts["epochs"]):
        # DistributedSampler-style: one permutation shared by all ranks, each takes every W-th row
        perm = torch.randperm(x_tr.shape[0], generator=torch.Generator().manual_seed(opts["seed"] + epoch))
        ddp.train()
        for b in range(steps_per_epoch):
            idx = perm[b * batch : (b + 1) * batch][rank::world]
            loss = loss_fn(ddp(x_tr[idx]), y_tr[idx])
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            losses[step] = loss.detach()
            elapsed[step] = time.perf_counter() - start
            step += 1
            if bar is not None:
                bar.advance(task)
        with torch.no_grad():  # every rank holds the same parameters, so evaluate locally
            model.eval()
            accuracy.append((model(x_te).argmax(1) == y_te).float().mean().item() * 100)
        epoch_end_s.append(time.perf_counter() - start)
    dist.barrier()
    wall = time.perf_counter() - start
    if isinstance(bar, _Lines):
        bar.finish(task)

    dist.all_reduce(losses)
    losses /= world
    numel = sum(p.numel() for p in model.parameters())
    raw = numel * 4 * step
    slow_link = None
    if state is not None:
        stats = state.stats(per_tensor=True)
        wire = int(stats["wire_bytes"])
        if state.comm.describe_topology().get("hierarchical"):
            # what crosses the node's one link: each rank's share of the compressed exchanges
            # (times the node's ranks), and the uncompressed ones' flat ring once
            rows = stats["per_tensor"].values()
            local = state.comm.topology.local_size
            slow_link = sum(r["sent_bytes"] * (local if r["compressed"] else 1) for r in rows)
        state.close()
    else:  # plain DDP sends fp32; PyTorch's fp16 hook sends half of that
        stats, wire = {}, raw // 2 if spec is not None and spec[0] == "torch:fp16_compress_hook" else raw
    collective = stats.get("collective", "allreduce")
    last = losses[-steps_per_epoch:]
    return {
        "config": name,
        "method": describe(name),
        "test_accuracy": accuracy[-1],
        "accuracy_per_epoch": accuracy,
        "wire_bytes": wire,
        "raw_bytes": raw,
        "ratio": raw / wire if wire else math.inf,
        "collective": collective,
        # on several nodes: the bytes on its node's link (see link_seconds)
        "node_link_bytes": slow_link,
        "wall_s": wall,
        "final_train_loss": float(last.mean()),
        "loss_per_step": losses.tolist(),
        "seconds_per_step": elapsed.tolist(),  # wall time since the start, rank 0's clock
        "seconds_to_95": next((t for a, t in zip(accuracy, epoch_end_s) if a >= 95.0), None),
        "steps": step,
        "identical": _identical(model),
        "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }


def demo_worker(rank: int, world: int, names: List[str], opts: Dict[str, Any], data) -> List[Dict[str, Any]]:
    """One rank of the demo: every configuration in turn (same order on every rank)."""
    total = opts["epochs"] * (data[0].shape[0] // opts["batch_size"])
    bar, tasks = _progress(rank, names, total)
    results = []
    if bar is not None:
        bar.start()
    try:
        for name in names:
            results.append(_train_one(name, data, opts, rank, world, bar, tasks.get(name)))
    finally:
        if bar is not None:
            bar.stop()
    return results


def _run_configs(configs: List[str], opts: Dict[str, Any], data, emu) -> List[Dict[str, Any]]:
    """Most configs in one spawn; each ISOLATED one alone, its failure recorded as a row."""
    shared = [c for c in configs if c not in ISOLATED]
    nodes = dict(cluster=emu, ranks_per_node=opts["ranks_per_node"] if opts["ranks_per_node"] > 1 else None)
    done = {r["config"]: r for r in spawn_local(demo_worker, opts["workers"], shared, opts, data, **nodes)} if shared else {}
    for name in [c for c in configs if c in ISOLATED]:
        try:
            done[name] = spawn_local(
                demo_worker, opts["workers"], [name], opts, data, **nodes,
                timeout_s=ISOLATED_TIMEOUT_S, deadline_s=ISOLATED_DEADLINE_S,
            )[0]
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            cause = next((ln for ln in lines if "hung" in ln), None) or next(
                (ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1] if lines else ""
            )
            done[name] = {"config": name, "method": describe(name), "error": cause[:300]}
    return [done[c] for c in configs]


def rate_label(rate: str) -> str:
    """``"1gbit"`` → ``"1 Gbit/s"``."""
    bps = cluster.parse_rate(rate)
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def link_seconds(wire_bytes: float, collective: str, workers: int, rate: str,
                 node_link_bytes: Optional[float] = None) -> float:
    """Time the bytes need on one rank's link: payload bytes per rank (every step, summed) ×
    the collective's pattern (ring all-gather W−1 payloads; all-reduce, SRA and PS 2(W−1)/W) / rate.
    A hierarchical exchange on nodes of L ranks gives ``node_link_bytes`` instead, the bytes on
    the node's one link: its L ranks' shares of the compressed exchanges sent across nodes
    (``sent_bytes`` of the compressed tensors × L), and the flat ring of the uncompressed ones."""
    if node_link_bytes is not None:
        return node_link_bytes * 8 / cluster.parse_rate(rate)
    factor = workers - 1 if collective == "allgather" else 2 * (workers - 1) / workers
    return factor * wire_bytes * 8 / cluster.parse_rate(rate)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def intro(report: Dict[str, Any]) -> List[str]:
    """The first lines of the demo's output: where it runs and what its times can show."""
    o, label = report["options"], rate_label(report["link_rate"])
    what = f"fp32 DDP against {', '.join(c for c in report['configs'] if c != 'fp32')}, {o['epochs']} epoch(s) each"
    if report["emulated"]:
        return [
            f"gradzip demo on an emulated {label} cluster: {report['network']}.",
            f"Every gradient byte crosses a {label} link, as between machines; {what}.",
        ]
    return [
        f"gradzip demo on {report['network']}.",
        "Loopback moves bytes at memory speed, so compression cannot show a gain here: the times measured are the"
        " codecs' CPU work.",
        f"Beside each time, 'wire s' is what the same bytes would take on a {label} link: payload bytes per rank per"
        " step × steps × (2(W−1)/W for all-reduce, SRA and PS; W−1 for all-gather) / link rate.",
        f"As root with iproute2 (ip, tc), `gradzip demo` measures it on an emulated {label} cluster; {what}.",
    ]


def headline(report: Dict[str, Any]) -> List[str]:
    """Where gradzip wins, from the run: 4-bit max-min (or the first codec) against fp32."""
    rows = {r["config"]: r for r in report["results"] if "error" not in r}
    fp32 = rows.get("fp32")
    codecs = [c for c in rows if CONFIGS[c] is not None and not CONFIGS[c][0].startswith("torch:")]
    if fp32 is None or not codecs:
        return []
    name = "maxmin4" if "maxmin4" in rows else codecs[0]
    r = rows[name]
    who = "maxmin 4-bit" if name == "maxmin4" else name
    label = rate_label(report["link_rate"])
    diff = r["test_accuracy"] - fp32["test_accuracy"]
    acc = f"{'same accuracy' if abs(diff) <= 1.0 else 'accuracy'} ({r['test_accuracy']:.1f}% vs {fp32['test_accuracy']:.1f}%)"
    fewer = fp32["wire_bytes"] / r["wire_bytes"]
    if not report["emulated"]:
        return [
            f"{who}: {fewer:.1f}× fewer bytes than fp32, {acc}; on a {label} link they would need"
            f" {r['link_s']:.3g} s of wire time against fp32's {fp32['link_s']:.3g} s (estimate).",
            f"Measured on loopback it took {r['wall_s']:.1f} s against fp32's {fp32['wall_s']:.1f} s: no network to save,"
            " only the codec's CPU work shows.",
        ]
    speed = fp32["wall_s"] / r["wall_s"]
    if speed < 1.05:
        return [
            f"{who}: no gain in this run at {label} ({r['wall_s']:.1f} s against fp32's {fp32['wall_s']:.1f} s), {acc},"
            f" though it sends {fewer:.1f}× fewer bytes ({r['link_s']:.3g} s of wire time against {fp32['link_s']:.3g} s):"
            f" the CPU was the limit ({report['options']['workers']} ranks on {report['cores']} cores).",
        ]
    lines = [f"{who}: {speed:.1f}× faster than fp32 at {label}, {acc}."]
    more = f"{r['wall_s']:.1f} s against {fp32['wall_s']:.1f} s for {r['steps']} steps; it sends {fewer:.1f}× fewer bytes"
    hook = rows.get("torch-fp16")
    if hook is not None:
        more += f"; {hook['wall_s'] / r['wall_s']:.1f}× faster than PyTorch's fp16 hook ({hook['wall_s']:.1f} s)"
    return lines + [more + "."]


def run_demo(
    configs: Sequence[str] = DEFAULT_CONFIGS,
    out: Optional[str] = "demo-results",
    echo: Optional[Callable[[str], None]] = None,
    **overrides: Any,
) -> Dict[str, Any]:
    """Train every config on local gloo ranks; write results.json and demo.png into ``out``.

    ``rate`` (e.g. ``"1gbit"``) runs on an emulated cluster where root and iproute2 allow, else on
    loopback; ``echo`` gets the opening lines (:func:`intro`) before training starts.
    """
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}")
    opts = {**DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    if isinstance(opts["rate"], str) and opts["rate"].strip().lower() in LOOPBACK:
        opts["rate"] = None
    if opts["batch_size"] < opts["workers"]:
        raise ValueError("--batch-size must be at least --workers (every rank needs a sample)")
    if opts["workers"] % opts["ranks_per_node"]:
        raise ValueError(f"--workers ({opts['workers']}) must be a multiple of --ranks-per-node ({opts['ranks_per_node']})")
    t0 = time.perf_counter()
    data = load_digits_split(opts["seed"])  # once, in the parent: the ranks need no scikit-learn
    reason = cluster.available() if opts["rate"] else None
    report: Dict[str, Any] = {
        "options": opts, "configs": list(configs), "emulated": bool(opts["rate"]) and reason is None,
        "link_rate": opts["rate"] if opts["rate"] and reason is None else REFERENCE_RATE, "cores": _cores(),
        "network": "loopback" if not opts["rate"] else f"loopback (no emulated cluster: {reason})",
    }
    per_node = opts["ranks_per_node"]
    emu = cluster.EmulatedCluster(
        opts["workers"] // per_node, opts["rate"], prefix=cluster.own_prefix("d"), ranks_per_node=per_node,
    ) if report["emulated"] else None
    if emu is not None:
        report["network"] = emu.describe()
    for line in intro(report) if echo else ():
        echo(line)
    if emu is not None:
        quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ  # c10d warns that a namespace has no hostname
        if quiet:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        try:
            with emu:
                results = _run_configs(list(configs), opts, data, emu)
        finally:
            if quiet:
                del os.environ["TORCH_CPP_LOG_LEVEL"]
    else:
        results = _run_configs(list(configs), opts, data, None)
    for r in results:
        if "error" not in r:
            r["link_s"] = link_seconds(r["wire_bytes"], r["collective"], opts["workers"], report["link_rate"],
                                       r.get("node_link_bytes"))
    report.update(total_wall_s=time.perf_counter() - t0, results=results)
    report["headline"] = headline(report)
    if out:
        os.makedirs(out, exist_ok=True)
        report["plot"] = os.path.join(out, "demo.png")
        try:
            plot(results, report["plot"], title=f"{report['network']}; " + " ".join(report["headline"][:1]))
        except ImportError as exc:
            report["plot"] = None
            missing = (exc.name or "matplotlib").split(".")[0]
            report["plot_skipped"] = f"no plot: {missing} is not installed (pip install gradzip[demo])"
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(report, f, indent=1)
    return report


# Line styles for the plot: equal curves (configs that train alike) stay visible side by side.
_STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P")]


def plot(results: List[Dict[str, Any]], path: str, title: str = "") -> None:
    """Training loss per step and against wall time, and test accuracy per epoch, a line per config.

    Every config has its own colour, line style and marker; fp32, the baseline, is drawn last, on
    top, as a thick translucent black line, so configs that train exactly like it still show. In
    the accuracy panel each config's points are shifted slightly along x, so equal values do not
    hide each other.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    drawn = [r for r in results if "error" not in r]  # a config that failed has no curve
    drawn.sort(key=lambda r: r["config"] == "fp32")  # the baseline last, on top
    fig, (ax_loss, ax_time, ax_acc) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3)
    styles = iter(_STYLES * 4)
    for i, r in enumerate(drawn):
        if r["config"] == "fp32":
            style = dict(color="black", linestyle="-", linewidth=3.0, alpha=0.45, zorder=10)
            marker = "*"
        else:
            dash, marker = next(styles)
            style = dict(color=next(colors), linestyle=dash, linewidth=1.3, zorder=3)
        loss = np.asarray(r["loss_per_step"])
        window = max(1, min(10, len(loss)))  # per-step losses of small batches are noisy
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        every = max(1, len(smooth) // 8)
        shown = dict(style, label=r["config"], marker=marker, markersize=5, markevery=(i * every // max(1, len(drawn)), every))
        ax_loss.plot(np.arange(window - 1, len(loss)), smooth, **shown)
        ax_time.plot(np.asarray(r["seconds_per_step"])[window - 1 :], smooth, **shown)
        epochs = np.arange(1, len(r["accuracy_per_epoch"]) + 1) + 0.06 * (i - (len(drawn) - 1) / 2)
        ax_acc.plot(epochs, r["accuracy_per_epoch"], **dict(style, label=r["config"], marker=marker, markersize=6))
    ax_loss.set(xlabel="step", ylabel="training loss (mean over ranks, 10-step mean)", yscale="log", title="Training loss")
    ax_time.set(xlabel="wall time (s)", ylabel="training loss (10-step mean)", yscale="log", title="Loss against wall time")
    ax_acc.set(xlabel="epoch (points of a config shifted slightly apart)", ylabel="test accuracy (%)", title="Test accuracy")
    if drawn:
        n_epochs = max(len(r["accuracy_per_epoch"]) for r in drawn)
        ax_acc.set_xticks(range(1, n_epochs + 1))
    for ax in (ax_loss, ax_time, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(report: Dict[str, Any]):
    """The results as a ``rich`` table (plain text without rich)."""
    from ..bench.tables import table as new_table

    o = report["options"]
    label = rate_label(report.get("link_rate", REFERENCE_RATE))
    t = new_table(
        title=f"gradzip demo: digits MLP (width {o['width']}), {o['workers']} gloo ranks, {o['epochs']} epochs,"
        f" batch {o['batch_size']}; {report.get('network', 'loopback')}",
    )
    wire = (
        f"wire s: time the payload bytes need on one rank's {label} link, MB/rank × (2(W−1)/W for all-reduce, SRA"
        " and PS; W−1 for all-gather) / link rate"
        + ("; hierarchical: the bytes on the node's link (its ranks' compressed shares sent across nodes, and"
           " the uncompressed gradients' flat ring) / link rate"
           if o.get("ranks_per_node", 1) > 1 else "")
        + ("" if report.get("emulated") else f" (an estimate: loopback has no {label} link)")
    )
    t.caption = (
        f"acc: test accuracy at the end; MB/rank: payload bytes each rank contributed over the run; {wire}; vs fp32:"
        " fp32's time / this time; loss: mean training loss of the last epoch; s to 95%: wall time until the test"
        " accuracy first reached 95% (checked after each epoch); identical: all ranks ended with bit-identical"
        " parameters"
    )
    fp32 = next((r for r in report["results"] if r["config"] == "fp32" and "error" not in r), None)
    cols = ("config", "acc %", "MB/rank", "ratio", "time s", "wire s", "vs fp32", "steps/s", "s to 95%", "loss", "identical")
    for col in cols:
        t.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    t.add_column("method", ratio=1)
    for r in report["results"]:
        if "error" in r:
            t.add_row(r["config"], *["-"] * (len(cols) - 2), "[red]failed[/red]", f"{r['method']}: {r['error']}")
            continue
        t.add_row(
            r["config"],
            f"{r['test_accuracy']:.2f}",
            f"{r['wire_bytes'] / 1e6:.2f}",
            f"{r['ratio']:.1f}×",
            f"{r['wall_s']:.1f}",
            "-" if r.get("link_s") is None else f"{r['link_s']:.3g}",
            "-" if fp32 is None else f"{fp32['wall_s'] / r['wall_s']:.2f}×",
            f"{r['steps'] / r['wall_s']:.1f}",
            "-" if r.get("seconds_to_95") is None else f"{r['seconds_to_95']:.1f}",
            f"{r['final_train_loss']:.4f}",
            "yes" if r["identical"] else "[red]NO[/red]",
            r["method"],
        )
    return t
