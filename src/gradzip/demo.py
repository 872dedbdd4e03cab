"""``gradzip demo``: data-parallel training of a small MLP with every codec, side by side.

The job trains a 64→256→256→10 MLP on scikit-learn's bundled digits (no download) on W local
gloo ranks wrapped in ``DistributedDataParallel``, once per configuration, all in one spawn so
process start-up is paid once. Every configuration starts from the same seed and sees the same
batches, so the only difference between rows is how gradients cross the wire. A small
``bucket_cap_mb`` gives DDP several buckets, the case where ordering bugs between ranks show.

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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import gradzip

from .bench import cluster
from .launch import spawn_local

# config name -> (codec, keyword arguments of gradzip.register); None means plain fp32 DDP.
CONFIGS: Dict[str, Optional[Tuple[str, Dict[str, Any]]]] = {
    "fp32": None,
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    "maxmin4": ("maxmin", {"bits": 4, "memory": "residual"}),
    "maxmin2": ("maxmin", {"bits": 2, "memory": "residual"}),
    "qsgd4": ("qsgd", {"bits": 4}),
    "topk": ("topk", {"ratio": 0.01}),
    "randomk": ("randomk", {"ratio": 0.01}),
    "powersgd": ("powersgd", {"rank": 2}),
    "efsignsgd": ("efsignsgd", {}),
    "terngrad": ("terngrad", {}),
    "natural": ("natural", {}),
    "u8bit": ("u8bit", {}),
    "inceptionn": ("inceptionn", {}),
    "tbq": ("tbq", {"threshold": 0.001}),
    "onebit": ("onebit", {}),
    "signsgd": ("signsgd", {}),
    "signum": ("signum", {}),
    "threshold": ("threshold", {"threshold": 0.001}),
    "dgc": ("dgc", {"ratio": 0.01}),
    "graddrop": ("graddrop", {"ratio": 0.01}),
    "adaq": ("adaq", {}),
    "sketchml": ("sketchml", {}),
    "maxmin4-ps": ("maxmin", {"bits": 4, "memory": "residual", "collective": "ps"}),
    "torch-fp16": ("torch:fp16_compress_hook", {}),  # PyTorch's own hooks, the baselines to beat
    "torch-powersgd": ("torch:powerSGD_hook", {"rank": 2}),
}
# Configs run in a spawn of their own with a short collective timeout, so that a failure (or a
# hang: PyTorch's PowerSGD hook issues all-reduces from Future callbacks, which with several
# buckets in flight can reach gloo in a different order on each rank) is recorded, not fatal.
ISOLATED = {"torch-powersgd"}
ISOLATED_TIMEOUT_S = 60  # one collective
ISOLATED_DEADLINE_S = 180  # the whole config
# Optimizer settings a method needs to work at all, applied on top of --lr/--momentum: sign
# methods send ±1 per element, so the step is lr per element (a far smaller lr, and Signum keeps
# its own momentum); DGC's momentum correction *is* the momentum, so the optimizer must not add
# another (with both, training diverges).
OPTIMIZER_OVERRIDES: Dict[str, Dict[str, float]] = {
    "signsgd": {"lr": 0.002, "momentum": 0.0},
    "signum": {"lr": 0.002, "momentum": 0.0},
    "dgc": {"momentum": 0.0},
}
DEFAULT_CONFIGS = ["fp32", "fp16", "maxmin4", "maxmin2", "topk", "powersgd", "efsignsgd"]

# Chosen so the default run (7 configs, 4 ranks) takes 1–2 minutes on 2 cores and fp32 reaches
# ≥ 95% test accuracy (≈97%); every rank gets batch_size / workers samples per step.
DEFAULTS = dict(workers=4, epochs=8, batch_size=64, lr=0.05, momentum=0.9, seed=0, width=256, rate=None)


def describe(name: str) -> str:
    """A config as text: ``maxmin bits=4 memory=residual``."""
    spec = CONFIGS[name]
    if spec is None:
        return "DDP all-reduce"
    codec, opts = spec
    if codec.startswith("torch:"):
        return f"PyTorch {codec[len('torch:'):]}"
    optim = OPTIMIZER_OVERRIDES.get(name, {})
    sgd = [f"(SGD {' '.join(f'{k}={v:g}' for k, v in optim.items())})"] if optim else []
    return " ".join([codec] + [f"{k}={v}" for k, v in opts.items()] + sgd)


def load_digits_split(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits (1797 × 64), standardized with the training split's statistics, 80/20 stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return as_x(x_tr), as_y(y_tr), as_x(x_te), as_y(y_te)


def make_model(seed: int, width: int = 256) -> nn.Module:
    """64 → width → width → 10 MLP; a larger ``width`` makes training communication-bound."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _progress(rank: int, names: Sequence[str], total: int):
    """Rank 0's progress bar (one task per config); other ranks get None."""
    if rank != 0:
        return None, {}
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

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
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    spec = CONFIGS[name]
    state = None
    if spec is not None and spec[0] == "torch:powerSGD_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        hook_state = psgd.PowerSGDState(None, matrix_approximation_rank=spec[1]["rank"], start_powerSGD_iter=2)
        ddp.register_comm_hook(hook_state, psgd.powerSGD_hook)
    elif spec is not None and spec[0].startswith("torch:"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, spec[0][len("torch:"):]))
    elif spec is not None:
        state = gradzip.register(ddp, spec[0], **spec[1])
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

    dist.all_reduce(losses)
    losses /= world
    numel = sum(p.numel() for p in model.parameters())
    raw = numel * 4 * step
    if state is not None:
        stats = state.stats()
        wire = int(stats["wire_bytes"])
        state.close()
    else:  # plain DDP sends fp32; PyTorch's fp16 hook sends half of that
        stats, wire = {}, raw // 2 if spec is not None and spec[0] == "torch:fp16_compress_hook" else raw
    last = losses[-steps_per_epoch:]
    return {
        "config": name,
        "method": describe(name),
        "test_accuracy": accuracy[-1],
        "accuracy_per_epoch": accuracy,
        "wire_bytes": wire,
        "raw_bytes": raw,
        "ratio": raw / wire if wire else math.inf,
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
    done = {r["config"]: r for r in spawn_local(demo_worker, opts["workers"], shared, opts, data, cluster=emu)} if shared else {}
    for name in [c for c in configs if c in ISOLATED]:
        try:
            done[name] = spawn_local(
                demo_worker, opts["workers"], [name], opts, data, cluster=emu,
                timeout_s=ISOLATED_TIMEOUT_S, deadline_s=ISOLATED_DEADLINE_S,
            )[0]
        except RuntimeError as exc:
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            cause = next((ln for ln in lines if "hung" in ln), None) or next(
                (ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1] if lines else ""
            )
            done[name] = {"config": name, "method": describe(name), "error": cause[:300]}
    return [done[c] for c in configs]


def run_demo(configs: Sequence[str] = DEFAULT_CONFIGS, out: Optional[str] = "demo-results", **overrides: Any) -> Dict[str, Any]:
    """Train every config on local gloo ranks; write results.json and demo.png into ``out``."""
    unknown = sorted(set(overrides) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(unknown)}")
    opts = {**DEFAULTS, **{k: v for k, v in overrides.items() if v is not None}}
    if opts["batch_size"] < opts["workers"]:
        raise ValueError("--batch-size must be at least --workers (every rank needs a sample)")
    t0 = time.perf_counter()
    data = load_digits_split(opts["seed"])  # once, in the parent: the ranks need no scikit-learn
    network = "loopback"
    reason = cluster.available() if opts["rate"] else None
    if opts["rate"] and reason is None:
        with cluster.EmulatedCluster(opts["workers"], opts["rate"]) as emu:
            network = emu.describe()
            results = _run_configs(list(configs), opts, data, emu)
    else:
        if opts["rate"]:
            network = f"loopback (no emulation: {reason})"
        results = _run_configs(list(configs), opts, data, None)
    report = {"options": opts, "network": network, "total_wall_s": time.perf_counter() - t0, "results": results}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(report, f, indent=1)
        plot(results, os.path.join(out, "demo.png"))
    return report


def plot(results: List[Dict[str, Any]], path: str) -> None:
    """Training loss per step and against wall time, and test accuracy per epoch, a line per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_loss, ax_time, ax_acc) = plt.subplots(1, 3, figsize=(17, 4.5))
    for r in results:
        if "error" in r:  # a config that failed has no curve
            continue
        loss = np.asarray(r["loss_per_step"])
        window = max(1, min(10, len(loss)))  # per-step losses of small batches are noisy
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
        ax_loss.plot(np.arange(window - 1, len(loss)), smooth, label=r["config"], linewidth=1)
        ax_time.plot(np.asarray(r["seconds_per_step"])[window - 1 :], smooth, label=r["config"], linewidth=1)
        epochs = range(1, len(r["accuracy_per_epoch"]) + 1)
        ax_acc.plot(epochs, r["accuracy_per_epoch"], marker="o", markersize=3, label=r["config"])
    ax_loss.set(xlabel="step", ylabel="training loss (mean over ranks, 10-step mean)", yscale="log", title="Training loss")
    ax_time.set(xlabel="wall time (s)", ylabel="training loss (10-step mean)", yscale="log", title="Loss against wall time")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="Test accuracy")
    for ax in (ax_loss, ax_time, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(report: Dict[str, Any]):
    """The results as a ``rich`` table."""
    from rich import box
    from rich.table import Table

    o = report["options"]
    t = Table(
        title=f"gradzip demo: digits MLP (width {o['width']}), {o['workers']} gloo ranks, {o['epochs']} epochs,"
        f" batch {o['batch_size']}; {report.get('network', 'loopback')}",
        box=box.SIMPLE_HEAD,
        padding=(0, 1, 0, 0),
    )
    t.caption = (
        "acc: test accuracy at the end; MB/rank: payload bytes each rank contributed (a ring all-gather moves"
        " (W−1)× that per rank, a ring all-reduce or SRA about 2(W−1)/W×); loss: mean training loss"
        " of the last epoch; s to 95%: wall time until the test accuracy first reached 95% (checked after each"
        " epoch); identical: all ranks ended with bit-identical parameters"
    )
    for col in ("config", "acc %", "MB/rank", "ratio", "time s", "steps/s", "s to 95%", "loss", "identical"):
        t.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    t.add_column("method", ratio=1)
    for r in report["results"]:
        if "error" in r:
            t.add_row(r["config"], *["-"] * 7, "[red]failed[/red]", f"{r['method']}: {r['error']}")
            continue
        t.add_row(
            r["config"],
            f"{r['test_accuracy']:.2f}",
            f"{r['wire_bytes'] / 1e6:.2f}",
            f"{r['ratio']:.1f}×",
            f"{r['wall_s']:.1f}",
            f"{r['steps'] / r['wall_s']:.1f}",
            "-" if r.get("seconds_to_95") is None else f"{r['seconds_to_95']:.1f}",
            f"{r['final_train_loss']:.4f}",
            "yes" if r["identical"] else "[red]NO[/red]",
            r["method"],
        )
    return t
