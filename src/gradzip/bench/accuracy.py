"""``gradzip bench accuracy``: what compression costs in held-out loss, at equal steps, on real data.

A codec that halves the step time but needs twice the steps has gained nothing. This benchmark
trains the same model from the same seed on the same batches once per configuration and reports
the held-out loss each reaches, the bytes it put on the wire to get there, and the wall time at
which it first matched plain fp32 DDP's final held-out loss (time-to-target, as in the
end-to-end comparisons of DGC, Lin et al., ICLR'18, and PowerSGD, Vogels et al., NeurIPS'19).

Two tasks, both on data that needs no download:

- ``digits``: scikit-learn's bundled 8×8 digits (1797 images, a fixed stratified 80/20 split),
  the demo's MLP (:func:`gradzip.tools.demo.make_model`), SGD with momentum; held-out cross-entropy and
  accuracy.
- ``charlm``: a character-level language model on the Python documentation topics that every
  Python installation ships (``pydoc_data.topics``, about 465,000 characters of English prose and
  code): a small causal transformer (two pre-norm blocks, width 128, context 64, about 430 K
  parameters), AdamW; held-out loss in nats per character (and bits per character). The text is
  cut into blocks of 2,048 characters and every 20th block is held out (5%), so the held-out
  text comes from all over the documentation.

Protocol: ``workers`` local gloo ranks in :class:`~torch.nn.parallel.DistributedDataParallel`
(several DDP buckets, as in the demo), every configuration and seed in one spawn of the ranks.
For a seed, every configuration starts from the same initial parameters and sees the same
global batches (rank r takes rows r, r+W, ... of the global batch), so rows differ only in how
gradients cross the wire. The held-out set is evaluated before the first step and every
``eval_every`` steps (split over the ranks, summed); the training clock stops while it runs.
After training every rank's parameters are gathered and compared bit by bit
(:func:`replica_check`): gradzip decodes on every rank what was sent, so replicas must never
drift, and a configuration whose replicas differ is reported (and the command exits 1).

Configurations are the demo's names (``fp32``, ``fp16``, ``maxmin4``, ``topk``, ``powersgd``,
``torch-fp16``, ...) or codec specs ``name[:key=value...]`` as in ``gradzip bench allreduce``:
a key that :func:`gradzip.register` takes (``memory``, ``collective``, ``min_numel``, ...) goes to
it, a collective option (``partitions``) to the collective, ``opt.lr`` / ``opt.momentum`` to the
optimizer, and every other key to the codec. New codecs and options therefore need no change
here.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

Batch = Tuple[torch.Tensor, torch.Tensor]

DEFAULT_TASKS = ["digits", "charlm"]
DEFAULT_CONFIGS = ["fp32", "fp16", "maxmin4", "topk", "powersgd:rank=4"]
DEFAULTS = dict(seeds=3, workers=4, rate="1gbit")
# --quick: a few steps of every task, for a smoke run
QUICK = dict(steps=40, eval_every=10, seeds=2)
# The link that loopback runs estimate their wire time on.
REFERENCE_RATE = "1gbit"
# What the ranks train: DDP (gradzip's all-reduce hook) or FSDP2 (its reduce-scatter, fully_shard).
FRONTENDS = ("ddp", "fsdp")
# The FSDP2 front end's default rows: plain, FSDP2's own bf16 reduce, gradzip on gradients, and on weights too.
FSDP_CONFIGS = ["fp32", "bf16-reduce", "maxmin4", "maxmin:bits=4:memory=residual:weight_bits=8"]
# Keys of a spec that go to the optimizer rather than to gradzip.
OPTIMIZER_KEYS = {"opt.lr": "lr", "opt.momentum": "momentum"}
# PyTorch's PowerSGD hook issues all-reduces from Future callbacks: with several DDP buckets on
# gloo the ranks can disagree on their order and hang (see the demo), so it is not offered.
UNSUPPORTED = {
    "torch-powersgd": "PyTorch's PowerSGD hook hangs with several DDP buckets on gloo; use gradzip's powersgd",
}
# DDP's bucket cap is the model's gradient size over this: several buckets in flight.
BUCKETS = 4
# Untimed steps of every configuration before the timed runs of a task.
WARMUP_STEPS = 2


# ------------------------------------------------------------------------------ the tasks

class Digits:
    """scikit-learn's digits, the demo's MLP, SGD with momentum; loss and accuracy."""

    name = "digits"
    title = "digits MLP (scikit-learn digits, 64-{width}-{width}-10)"
    unit = "nats"
    steps = 120  # 5.5 epochs: fp32 reaches its plateau (about 97% held-out accuracy)
    eval_every = 10
    batch = 64  # global; each rank takes batch / W of it
    width = 512
    lr, momentum = 0.05, 0.9

    def load(self) -> Dict[str, Any]:
        from .digits import load_digits_split

        x_tr, y_tr, x_te, y_te = load_digits_split(0)  # a fixed split, whatever the seed
        return {"x_tr": x_tr, "y_tr": y_tr, "x_te": x_te, "y_te": y_te}

    def about(self, data: Dict[str, Any]) -> Dict[str, Any]:
        return {
            "train_examples": int(data["x_tr"].shape[0]), "heldout_examples": int(data["x_te"].shape[0]),
            "global_batch": self.batch, "optimizer": f"SGD lr={self.lr} momentum={self.momentum}",
            "model": f"MLP 64-{self.width}-{self.width}-10",
        }

    def model(self, seed: int, data: Dict[str, Any]) -> nn.Module:
        from .digits import make_model

        return make_model(seed, self.width)

    def optimizer(self, params, overrides: Dict[str, float]) -> torch.optim.Optimizer:
        sgd = {"lr": self.lr, "momentum": self.momentum, **overrides}
        return torch.optim.SGD(params, **sgd)

    def batch_of(self, data: Dict[str, Any], step: int, seed: int, rank: int, world: int) -> Batch:
        n = data["x_tr"].shape[0]
        per_epoch = n // self.batch  # the last partial batch is dropped: equal steps on every rank
        epoch, b = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        idx = perm[b * self.batch:(b + 1) * self.batch][rank::world]
        return data["x_tr"][idx], data["y_tr"][idx]

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y)

    def units(self, model: nn.Module) -> List[nn.Module]:
        """The modules sharded as FSDP2 units (the root is one too): every linear layer."""
        return [m for m in model if isinstance(m, nn.Linear)]

    def evaluate(self, model: nn.Module, data: Dict[str, Any], rank: int, world: int) -> Dict[str, float]:
        x, y = data["x_te"][rank::world], data["y_te"][rank::world]
        with torch.no_grad():
            out = model(x)
            loss = F.cross_entropy(out, y, reduction="sum").item()
            sums = torch.tensor([loss, float((out.argmax(1) == y).sum()), float(len(y))], dtype=torch.float64)
        dist.all_reduce(sums)
        return {"loss": sums[0].item() / sums[2].item(), "accuracy": 100.0 * sums[1].item() / sums[2].item()}


class WideDigits(Digits):
    """The digits task with a 64-2048-2048-10 MLP (4.3 M parameters, 17 MB of fp32 gradients): at
    1 Gbit/s its all-reduce costs far more than its compute, as a large model's does, so the
    time to a target loss shows what compression saves in wall time."""

    name = "digits-wide"
    width = 2048


class _Block(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """A small causal character-level transformer. Positions are a parameter, the causal mask is
    implicit: no registered buffers (DDP would broadcast them from rank 0 at every forward)."""

    def __init__(self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def pydoc_text() -> str:
    """The Python documentation topics bundled with every Python installation, in key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharLM:
    """A character-level transformer on ``pydoc_data.topics``; held-out loss in nats per character."""

    name = "charlm"
    title = "char-level transformer LM (pydoc_data.topics)"
    unit = "nats/char"
    steps = 150
    eval_every = 15
    batch = 32  # global windows per step
    context = 64
    block = 2048  # the text is cut into blocks of this many characters ...
    heldout_every = 20  # ... and every 20th is held out
    dim, layers, heads = 128, 2, 4
    lr = 3e-3

    def load(self) -> Dict[str, Any]:
        text = pydoc_text()
        vocab = sorted(set(text))
        index = {c: i for i, c in enumerate(vocab)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
        blocks = list(torch.split(ids, self.block))
        held = [b for i, b in enumerate(blocks) if i % self.heldout_every == self.heldout_every // 2]
        train = torch.cat([b for i, b in enumerate(blocks) if i % self.heldout_every != self.heldout_every // 2])
        span = self.context + 1  # non-overlapping windows of the held-out blocks: inputs and next characters
        windows = torch.cat([b[: len(b) // span * span].view(-1, span) for b in held if len(b) >= span])
        return {"train": train, "heldout": windows, "vocab": len(vocab), "chars": len(text)}

    def about(self, data: Dict[str, Any]) -> Dict[str, Any]:
        return {
            "text_chars": data["chars"], "vocab": data["vocab"], "train_chars": int(data["train"].numel()),
            "heldout_chars": int(data["heldout"].shape[0] * self.context), "context": self.context,
            "global_batch": f"{self.batch} windows of {self.context}",
            "optimizer": f"AdamW lr={self.lr} weight_decay=0",
            "model": f"causal transformer, {self.layers} blocks, width {self.dim}, {self.heads} heads",
        }

    def model(self, seed: int, data: Dict[str, Any]) -> nn.Module:
        torch.manual_seed(seed)
        return CharTransformer(data["vocab"], self.dim, self.layers, self.heads, self.context)

    def optimizer(self, params, overrides: Dict[str, float]) -> torch.optim.Optimizer:
        opts: Dict[str, Any] = {"lr": overrides.get("lr", self.lr), "weight_decay": 0.0}
        if "momentum" in overrides:
            opts["betas"] = (overrides["momentum"], 0.999)
        return torch.optim.AdamW(params, **opts)

    def batch_of(self, data: Dict[str, Any], step: int, seed: int, rank: int, world: int) -> Batch:
        train = data["train"]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, train.numel() - self.context - 1, (self.batch,), generator=gen)[rank::world]
        rows = torch.stack([train[s: s + self.context + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def units(self, model: nn.Module) -> List[nn.Module]:
        """The FSDP2 units besides the root: the transformer blocks, as one shards any transformer."""
        return list(model.blocks)

    def evaluate(self, model: nn.Module, data: Dict[str, Any], rank: int, world: int) -> Dict[str, float]:
        windows = data["heldout"][rank::world]
        with torch.no_grad():
            out = model(windows[:, :-1])
            total = F.cross_entropy(out.reshape(-1, out.shape[-1]), windows[:, 1:].reshape(-1), reduction="sum")
        sums = torch.tensor([total.item(), float(windows[:, 1:].numel())], dtype=torch.float64)
        dist.all_reduce(sums)
        loss = sums[0].item() / sums[1].item()
        return {"loss": loss, "bits_per_char": loss / math.log(2)}


TASKS = {"digits": Digits, "charlm": CharLM, "digits-wide": WideDigits}


def _task(name: str):
    return TASKS[name]()


# ---------------------------------------------------------------------------- the configs

def _register_keys() -> set:
    """The keywords :func:`gradzip.register` takes besides codec options (read from its signature)."""
    from ..frontends.ddp import register

    params = inspect.signature(register).parameters
    return {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"config", "group", "collective_options"}


def _collective_keys() -> Tuple[str, ...]:
    from .. import config

    return tuple(getattr(config, "COLLECTIVE_OPTIONS", ()))


def resolve(config: str, frontend: str = "ddp") -> Dict[str, Any]:
    """A configuration: a demo config name or a codec spec ``name[:key=value...]``; on the
    ``fsdp`` front end also ``bf16-reduce`` (FSDP2's own bf16 reduce).

    Returns ``{"config", "label", "kind" ("fp32", "torch", "bf16-reduce" or "gradzip"), "codec",
    "register" (keywords of gradzip.register), "optimizer" (overrides)}``; ``ValueError`` for an
    unknown name, option or value (the codec is built once to check it), or one the front end
    does not take.
    """
    from ..codecs import codec as make_codec
    from ..config import Config
    from .methods import CONFIGS, OPTIMIZER_OVERRIDES, describe
    from .micro import parse_spec

    if frontend not in FRONTENDS:
        raise ValueError(f"unknown front end {frontend!r}; choose from: {', '.join(FRONTENDS)}")
    config = config.strip()
    if config in UNSUPPORTED:
        raise ValueError(f"{config}: {UNSUPPORTED[config]}")
    if config == "bf16-reduce":
        if frontend != "fsdp":
            raise ValueError("bf16-reduce is FSDP2's bf16 reduce (MixedPrecisionPolicy): run it with the fsdp front "
                             "end; on DDP compare with fp16 or torch-fp16")
        return {"config": config, "label": "FSDP2 reduce-scatter in bf16 (MixedPrecisionPolicy)", "kind": "bf16-reduce",
                "register": {}, "optimizer": {}}
    if config in CONFIGS:
        spec = CONFIGS[config]
        if spec is None:
            label = "FSDP2 reduce-scatter (fp32)" if frontend == "fsdp" else "DDP all-reduce (fp32)"
            return {"config": config, "label": label, "kind": "fp32", "register": {}, "optimizer": {}}
        name, opts = spec[0], dict(spec[1])
        if name.startswith("torch:"):
            if frontend == "fsdp":
                raise ValueError(f"{config} is a DDP communication hook; FSDP2 has none (compare with bf16-reduce)")
            return {"config": config, "label": describe(config), "kind": "torch", "hook": name[len("torch:"):],
                    "register": {}, "optimizer": dict(OPTIMIZER_OVERRIDES.get(config, {}))}
        optimizer = dict(OPTIMIZER_OVERRIDES.get(config, {}))
    else:
        name, opts = parse_spec(config)
        optimizer = {OPTIMIZER_KEYS[k]: float(opts.pop(k)) for k in list(opts) if k in OPTIMIZER_KEYS}
    if not name:
        raise ValueError(f"empty codec name in {config!r}")
    register_keys, collective_keys = _register_keys(), _collective_keys()
    codec_opts = {k: v for k, v in opts.items() if k not in register_keys and k not in collective_keys}
    resolved = Config(codec=name).resolved()  # "auto": maxmin under the planner
    built = make_codec(resolved.codec, **{**resolved.options, **codec_opts})  # ValueError naming the valid codecs or options
    kwargs = {k: v for k, v in opts.items() if k not in collective_keys}  # register passes codec options on
    if frontend == "fsdp":
        from ..comm.reducescatter import CompressedReduceScatter
        from ..frontends.fsdp import DDP_ONLY

        odd = sorted(k for k in opts if k in DDP_ONLY or k in collective_keys)
        if odd:
            raise ValueError(f"{config}: {', '.join(odd)} only apply to DDP, not to an FSDP2 model")
        if name == "auto" or not CompressedReduceScatter(None).supports(built):
            raise ValueError(f"{config}: codec {name!r} cannot compress FSDP2's reduce-scatter")
    elif "weight_bits" in opts:
        raise ValueError(f"{config}: weight_bits compresses FSDP2's weight all-gather: run it with the fsdp front end")
    coll = {k: v for k, v in opts.items() if k in collective_keys}
    if coll:
        kwargs["collective_options"] = coll
    label = " ".join([name] + [f"{k}={v}" for k, v in opts.items()])
    if optimizer:
        label += f" (optimizer {' '.join(f'{k}={v:g}' for k, v in optimizer.items())})"
    return {
        "config": config, "label": label, "kind": "gradzip", "codec": name, "register": kwargs, "optimizer": optimizer,
    }


# ------------------------------------------------------------------------------ the ranks

def replica_check(flats: Sequence[torch.Tensor]) -> Dict[str, Any]:
    """Compare every rank's flattened parameters with rank 0's, bit by bit.

    Returns ``identical`` (all bit-identical; NaNs compare by their bits, so replicas that diverged
    together to NaN still count as identical), ``differing_ranks`` and ``max_abs_diff`` (the
    largest elementwise difference from rank 0's, 0.0 when identical).
    """
    ref = flats[0].detach().contiguous()
    ref_bits = ref.view(torch.uint8)
    differing, worst = [], 0.0
    for r, flat in enumerate(flats[1:], start=1):
        flat = flat.detach().contiguous()
        if flat.shape != ref.shape or not torch.equal(flat.view(torch.uint8), ref_bits):
            differing.append(r)
            if flat.shape == ref.shape:
                diff = (flat.double() - ref.double()).abs()
                diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
                worst = max(worst, diff.max().item())
            else:
                worst = math.inf
    return {"identical": not differing, "differing_ranks": differing, "max_abs_diff": worst}


def replicas(model: nn.Module) -> Dict[str, Any]:
    """:func:`replica_check` over every rank's parameters (an all-gather; call on every rank).
    Sharded (FSDP2) parameters are compared whole: each rank's all-gather of them."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in full])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return replica_check(gathered)


def _eligible(p: torch.Tensor) -> bool:
    """Would gradzip's default filter compress this gradient (2-D or more, ≥ min_numel values)?"""
    from ..config import Config

    cfg = Config()
    return p.numel() >= cfg.min_numel and (cfg.compress_1d or p.dim() > 1)


def _bytes(method: Dict[str, Any], model: nn.Module, state: Any, world: int) -> Dict[str, Any]:
    """Bytes per step: raw and on the wire, for all tensors and for the compressed ones alone."""
    from ..comm.base import traffic_factor

    if state is not None:
        stats = state.stats(per_tensor=True)
        steps = max(stats["steps"], 1)
        rows = stats["per_tensor"].values()
        comp = [r for r in rows if r["compressed"]]
        return {
            "raw_per_step": stats["raw_bytes"] / steps, "wire_per_step": stats["wire_bytes"] / steps,
            "sent_per_step": stats["sent_bytes"] / steps,
            "raw_per_step_compressed": sum(r["raw_bytes"] for r in comp) / steps,
            "wire_per_step_compressed": sum(r["wire_bytes"] for r in comp) / steps,
            "ratio": stats["ratio"], "collective": stats["collective"], "memory": stats["memory"],
            "params_compressed": stats["params_compressed"], "params_uncompressed": stats["params_uncompressed"],
        }
    params = list(model.parameters())
    sharded = method.get("frontend") == "fsdp"
    raw = sum(p.numel() * 4 for p in params)
    raw_c = sum(p.numel() * 4 for p in params if sharded or _eligible(p))
    half = method["kind"] == "bf16-reduce" or (method["kind"] == "torch" and method.get("hook") == "fp16_compress_hook")
    wire, wire_c = (raw / 2, raw_c / 2) if half else (raw, raw_c)
    collective = "reducescatter" if sharded else "allreduce"
    factor = (world - 1) / world if sharded else traffic_factor(collective, world)  # a reduce-scatter: half an all-reduce
    return {
        "raw_per_step": raw, "wire_per_step": wire, "sent_per_step": factor * wire,
        "raw_per_step_compressed": raw_c, "wire_per_step_compressed": wire_c, "ratio": raw / wire,
        "collective": collective, "memory": "none",
        "params_compressed": sum(1 for p in params if _eligible(p)) if half else 0,
        "params_uncompressed": sum(1 for p in params if not (half and _eligible(p))),
    }


def _sent_so_far(state: Any, per_step: Optional[float], step: int) -> float:
    if state is None:
        return per_step * step
    return float(state.stats()["sent_bytes"])


def _ddp(model: nn.Module, method: Dict[str, Any]) -> nn.Module:
    """``model`` in DDP with several buckets, PyTorch's hook on it where the method is one."""
    from torch.nn.parallel import DistributedDataParallel

    grad_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    ddp = DistributedDataParallel(model, bucket_cap_mb=grad_mb / BUCKETS)
    if method["kind"] == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, method["hook"]))
    return ddp


def _fsdp(task, model: nn.Module, method: Dict[str, Any]) -> nn.Module:
    """``model`` sharded with FSDP2: the task's units, then the root; a bf16 reduce where asked."""
    import warnings

    from .sharded import shard

    # FSDP2 warns that a root returning a view loses its pre-backward hook to an in-place op; none follows here
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    return shard(model, task.units(model), method["kind"] == "bf16-reduce")


def _train_one(
    task, data, method: Dict[str, Any], seed: int, steps: int, eval_every: int, rank: int, world: int,
) -> Dict[str, Any]:
    """One configuration, one seed, from scratch; every rank returns the same record."""
    import gradzip

    model = task.model(seed, data)
    sharded = method.get("frontend") == "fsdp"
    ddp = _fsdp(task, model, method) if sharded else _ddp(model, method)
    state = gradzip.register(ddp, method["codec"], **method["register"]) if method["kind"] == "gradzip" else None
    optim = task.optimizer(ddp.parameters(), method["optimizer"])
    per_step = None
    if state is None:  # fixed: what plain DDP or PyTorch's hook send every step
        per_step = _bytes(method, model, None, world)["sent_per_step"]

    def point(step: int, train_s: float) -> Dict[str, Any]:
        model.eval()
        metrics = task.evaluate(model, data, rank, world)
        model.train()
        return {"step": step, "time_s": train_s, "sent_bytes": _sent_so_far(state, per_step, step), **metrics}

    try:
        dist.barrier()
        curve = [point(0, 0.0)]
        train_s = 0.0
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            x, y = task.batch_of(data, step - 1, seed, rank, world)
            loss = task.loss(ddp(x), y)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            train_s += time.perf_counter() - t0
            if step % eval_every == 0 or step == steps:
                curve.append(point(step, train_s))  # the clock is stopped while evaluating
        check = replicas(model)
        traffic = _bytes(method, model, state, world)
        levels = _levels(state)
        if state is not None:
            curve[-1]["sent_bytes"] = float(state.stats()["sent_bytes"])  # every bucket of the last step counted
    finally:
        if state is not None:
            state.close()
    final = curve[-1]
    return {
        "task": task.name, "config": method["config"], "label": method["label"], "seed": seed, "steps": steps,
        "train_s": train_s, "curve": curve, "final_loss": final["loss"], "initial_loss": curve[0]["loss"],
        "final_accuracy": final.get("accuracy"), "final_bits_per_char": final.get("bits_per_char"),
        "bytes": traffic, "replicas": check, "identical": check["identical"], "levels": levels,
    }


def _levels(state: Any) -> Optional[Dict[str, Any]]:
    """Adaptive levels at the end of a run: how many parameters at each, the planned bytes of
    the compressed parameters and the uniform level's; None without adaptive levels."""
    if getattr(state, "levels", None) is None:
        return None
    lv = state.plan()["levels"]
    counts: Dict[str, int] = {}
    for level in lv["per_parameter"].values():
        counts[str(level)] = counts.get(str(level), 0) + 1
    keep = ("option", "uniform", "plans", "bytes", "uniform_bytes", "error", "uniform_error")
    return {**{k: lv[k] for k in keep if k in lv}, "count": dict(sorted(counts.items(), key=lambda kv: float(kv[0])))}


def accuracy_worker(
    rank: int, world: int, tasks: Sequence[str], methods: Sequence[Dict[str, Any]], seeds: Sequence[int],
    steps: Dict[str, int], eval_every: Dict[str, int], data: Dict[str, Any],
) -> List[Dict[str, Any]]:
    """One rank: for each task, for each seed, every configuration in turn (same order on every rank)."""
    runs = []
    for name in tasks:
        task = _task(name)
        for method in methods:  # untimed: first-use costs (kernels, allocator, threads) land here, not on a row
            _train_one(task, data[name], method, seeds[0], WARMUP_STEPS, WARMUP_STEPS, rank, world)
        for seed in seeds:
            for method in methods:
                run = _train_one(task, data[name], method, seed, steps[name], eval_every[name], rank, world)
                runs.append(run)
                if rank == 0:
                    print(
                        f"  {name:>7} seed {seed} {method['config']:<18} held-out {run['final_loss']:.4f}"
                        f"  {run['train_s']:6.1f} s{'' if run['identical'] else '  REPLICAS DIFFER'}",
                        file=sys.stderr, flush=True,
                    )
    return runs


# ------------------------------------------------------------------------------ the parent

def time_to_target(curve: Sequence[Dict[str, Any]], target: Optional[float]) -> Tuple[Optional[float], Optional[int]]:
    """(training seconds, step) of the first evaluation whose held-out loss is at most ``target``;
    (None, None) if none is (a non-finite loss never is)."""
    if target is None or not _finite(target):
        return None, None
    for p in curve:
        if _finite(p.get("loss")) and p["loss"] <= target:
            return p["time_s"], p["step"]
    return None, None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _spread(values: Sequence[Any]) -> Dict[str, Optional[float]]:
    vals = [v for v in values if _finite(v)]
    if not vals:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {
        "mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
        "min": min(vals), "max": max(vals), "n": len(vals),
    }


def _optional_spread(runs: Sequence[Dict[str, Any]], key: str) -> Optional[Dict[str, Optional[float]]]:
    """:func:`_spread` of a metric that only some tasks have (None for the others)."""
    return None if runs[0].get(key) is None else _spread([r[key] for r in runs])


def _mean_curve(curves: Sequence[Sequence[Dict[str, Any]]]) -> Dict[str, List[Optional[float]]]:
    """Per evaluation point: the step, and mean/min/max over seeds of loss, time and bytes sent."""
    n = min(len(c) for c in curves)
    out: Dict[str, List[Any]] = {"step": [curves[0][i]["step"] for i in range(n)]}
    for key in ("loss", "time_s", "sent_bytes"):
        stats = [_spread([c[i].get(key) for c in curves]) for i in range(n)]
        out[f"{key}_mean"] = [s["mean"] for s in stats]
        if key == "loss":
            out["loss_min"] = [s["min"] for s in stats]
            out["loss_max"] = [s["max"] for s in stats]
    return out


def summarize(
    runs: Sequence[Dict[str, Any]], tasks: Sequence[str], configs: Sequence[str], tolerance: float = 0.0,
) -> Dict[str, Any]:
    """Per task and configuration: the final held-out loss over seeds, its difference from the
    baseline's (fp32, or the first configuration) seed by seed, bytes per step, training time,
    time-to-target (the baseline's final held-out loss of the same seed, × (1 + tolerance)) and
    whether every seed ended with bit-identical replicas."""
    out: Dict[str, Any] = {}
    for task in tasks:
        mine = [r for r in runs if r["task"] == task]
        if not mine:
            continue
        baseline = "fp32" if "fp32" in configs else configs[0]
        base = {r["seed"]: r for r in mine if r["config"] == baseline}
        targets = {s: r["final_loss"] * (1 + tolerance) if _finite(r["final_loss"]) else None for s, r in base.items()}
        rows = []
        for config in configs:
            rs = sorted((r for r in mine if r["config"] == config), key=lambda r: r["seed"])
            if not rs:
                continue
            reach = []
            for r in rs:
                t, s = time_to_target(r["curve"], targets.get(r["seed"]))
                r["time_to_target_s"], r["steps_to_target"] = t, s
                reach.append(t)
            diffs = [r["final_loss"] - base[r["seed"]]["final_loss"] for r in rs
                     if r["seed"] in base and _finite(r["final_loss"]) and _finite(base[r["seed"]]["final_loss"])]
            b = rs[0]["bytes"]
            # bytes vary by seed only for codecs whose payload depends on the data: their mean; counts as they are
            averaged = [k for k in b if k.endswith("_step") or k == "ratio"]
            mean_bytes = {k: statistics.fmean(r["bytes"][k] for r in rs) for k in averaged}
            rows.append({
                "config": config, "label": rs[0]["label"], "seeds": [r["seed"] for r in rs],
                "final_loss": _spread([r["final_loss"] for r in rs]),
                "initial_loss": _spread([r["initial_loss"] for r in rs]),
                "delta_vs_baseline": _spread(diffs) if config != baseline else None,
                "final_accuracy": _optional_spread(rs, "final_accuracy"),
                "final_bits_per_char": _optional_spread(rs, "final_bits_per_char"),
                "bytes_per_step": {**b, **mean_bytes},
                "train_s": _spread([r["train_s"] for r in rs]),
                "time_to_target_s": _spread(reach), "reached": sum(1 for t in reach if t is not None),
                "identical": all(r["identical"] for r in rs),
                "max_replica_diff": max(r["replicas"]["max_abs_diff"] for r in rs),
                "curve": _mean_curve([r["curve"] for r in rs]),
            })
        out[task] = {"baseline": baseline, "targets": targets, "rows": rows}
    return out


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _sanitize(obj: Any) -> Any:
    """JSON has no NaN or infinity: they become None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj


def run_accuracy(
    tasks: Sequence[str] = DEFAULT_TASKS, configs: Sequence[str] = DEFAULT_CONFIGS, seeds: int = DEFAULTS["seeds"],
    steps: Optional[int] = None, eval_every: Optional[int] = None, workers: int = DEFAULTS["workers"],
    rate: Optional[str] = DEFAULTS["rate"], tolerance: float = 0.0, json_path: Optional[str] = None,
    timeout_s: float = 300, frontend: str = "ddp",
) -> Dict[str, Any]:
    """Train every task × seed × configuration on ``workers`` local gloo ranks; return the report.

    ``frontend``: ``ddp`` (DistributedDataParallel, gradzip's hook) or ``fsdp`` (FSDP2, each task's
    units and the root ``fully_shard``-ed, gradzip's reduce-scatter; ``bf16-reduce`` is FSDP2's
    own bf16 reduce).

    ``steps`` / ``eval_every`` override every task's own; ``rate`` runs on an emulated cluster of
    that link rate where root and iproute2 allow (else on loopback, and ``fallback`` says why).
    """
    import json

    from ..comm.launch import spawn_local
    from . import cluster
    from .micro import usable_cores

    tasks = list(dict.fromkeys(tasks))
    configs = list(dict.fromkeys(configs))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(TASKS)}")
    if seeds < 1 or workers < 1 or (steps is not None and steps < 1) or (eval_every is not None and eval_every < 1):
        raise ValueError("seeds, workers, steps and eval_every must be at least 1")
    methods = [dict(resolve(c, frontend), frontend=frontend) for c in configs]
    objs = {t: _task(t) for t in tasks}
    for t in objs.values():
        if t.batch < workers:
            raise ValueError(f"{t.name}: its global batch ({t.batch}) must be at least --workers ({workers})")
    n_steps = {t: steps or objs[t].steps for t in tasks}
    every = {t: min(eval_every or objs[t].eval_every, n_steps[t]) for t in tasks}
    seed_list = list(range(seeds))
    t0 = time.perf_counter()
    data = {t: objs[t].load() for t in tasks}  # in the parent: the ranks need no scikit-learn
    cores = usable_cores()
    report: Dict[str, Any] = {
        "tasks": tasks, "configs": configs, "frontend": frontend, "seeds": seed_list, "workers": workers, "rate": rate,
        "steps": n_steps, "eval_every": every, "tolerance": tolerance, "cores": cores, "emulated": False,
        "network": "loopback", "fallback": None, "link_rate": REFERENCE_RATE,
        "methods": {m["config"]: m["label"] for m in methods},
    }
    load_start = _loadavg()
    with contextlib.ExitStack() as stack:
        emu = None
        if rate:
            reason = cluster.available()
            if reason is None:
                try:
                    emu = stack.enter_context(cluster.EmulatedCluster(workers, rate, prefix=cluster.own_prefix("a")))
                except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                    reason = f"building it failed: {str(getattr(exc, 'stderr', None) or exc).strip()}"
            if emu is None:
                report["fallback"] = (
                    f"no emulated {rate} cluster ({reason}): running on plain loopback, where bytes cost next to"
                    " nothing, so wall times show CPU work only"
                )
                report["network"] = f"loopback (no emulated cluster: {reason})"
                print(f"gradzip bench accuracy: {report['fallback']}", file=sys.stderr, flush=True)
            else:
                report.update(network=emu.describe(), emulated=True, link_rate=rate)
                if "TORCH_CPP_LOG_LEVEL" not in os.environ:  # c10d warns that a namespace has no hostname
                    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
                    stack.callback(os.environ.pop, "TORCH_CPP_LOG_LEVEL", None)
        runs = spawn_local(
            accuracy_worker, workers, tasks, methods, seed_list, n_steps, every, data, cluster=emu, timeout_s=timeout_s,
        )
    report["about"] = {t: {"title": objs[t].title.format(width=getattr(objs[t], "width", "")), "unit": objs[t].unit,
                           **objs[t].about(data[t])} for t in tasks}
    for t in tasks:  # parameter count, from the first run's bytes (4 bytes a value)
        first = next(r for r in runs if r["task"] == t)
        report["about"][t]["params"] = int(first["bytes"]["raw_per_step"] // 4)
    report["results"] = summarize(runs, tasks, configs, tolerance)
    report["runs"] = runs
    report["wall_s"] = time.perf_counter() - t0
    report["loadavg"] = [load_start, _loadavg()]
    report = _sanitize(report)
    if json_path:
        if os.path.dirname(json_path):
            os.makedirs(os.path.dirname(json_path), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def all_identical(report: Dict[str, Any]) -> bool:
    return all(row["identical"] for task in report["results"].values() for row in task["rows"])


# ------------------------------------------------------------------------------ output

COLUMNS = (
    "config", "held-out", "min–max", "Δ fp32", "acc / bpc", "kB/step 2-D", "kB/step all", "ratio", "train s",
    "s to target", "identical",
)


def _f(x: Optional[float], fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _cells(report: Dict[str, Any], none: str = "-") -> List[Tuple[str, List[str]]]:
    """(task, row cells) for every configuration."""
    out = []
    for task, res in report["results"].items():
        for r in res["rows"]:
            fl, d, b, tt = r["final_loss"], r["delta_vs_baseline"], r["bytes_per_step"], r["time_to_target_s"]
            if r.get("final_accuracy"):
                metric = _f(r["final_accuracy"]["mean"], ".2f", none) + " %"
            elif r.get("final_bits_per_char"):
                metric = _f(r["final_bits_per_char"]["mean"], ".3f", none) + " bpc"
            else:
                metric = none
            n = len(r["seeds"])
            reached = f"{_f(tt['mean'], '.1f', none)} ({r['reached']}/{n})" if r["reached"] else f"{none} (0/{n})"
            out.append((task, [
                r["config"], _f(fl["mean"], ".4f", none),
                f"{_f(fl['min'], '.4f', none)}–{_f(fl['max'], '.4f', none)}",
                none if d is None else _f(d["mean"], "+.4f", none),
                metric,
                _f(b.get("wire_per_step_compressed") and b["wire_per_step_compressed"] / 1e3, ".1f", none),
                _f(b.get("wire_per_step") and b["wire_per_step"] / 1e3, ".1f", none),
                _f(b["raw_per_step"] / b["wire_per_step"] if b.get("wire_per_step") else None, ".1f", none) + "×",
                _f(r["train_s"]["mean"], ".1f", none),
                reached,
                "yes" if r["identical"] else f"NO (max diff {r['max_replica_diff']:.3g})",
            ]))
    return out


def caption(report: Dict[str, Any]) -> str:
    base = ", ".join(f"{t}: {res['baseline']}" for t, res in report["results"].items())
    tol = report.get("tolerance") or 0.0
    load = report.get("loadavg") or [None, None]
    text = (
        "held-out: held-out loss after the last step (digits: cross-entropy in nats; charlm: nats/char), mean over"
        f" {len(report['seeds'])} seed(s); min–max over the seeds; Δ fp32: mean over seeds of this config's held-out"
        f" loss minus the baseline's ({base}) for the same seed; acc / bpc: held-out accuracy (digits) or bits per"
        " character (charlm); kB/step: payload bytes each rank contributes per step (one encoding of each gradient),"
        + (" for the units gradzip compresses and for all (the gradients' reduce-scatter; weights' all-gather not"
           " counted)" if report.get("frontend") == "fsdp" else " for the tensors gradzip compresses (2-D, ≥ 1024 values)"
           " and for all") + "; ratio: raw / payload bytes, all"
        " tensors; train s: training wall time, evaluation excluded (mean); s to target: training seconds until the"
        f" held-out loss first reached the baseline's final held-out loss{f' × {1 + tol:g}' if tol else ''} of the"
        " same seed (checked every eval step), mean over the seeds that reached it (reached/seeds); identical: every"
        " rank ended every seed with bit-identical parameters"
    )
    if None not in load:
        text += f"; machine load (1 min) {load[0]:.1f} at start, {load[1]:.1f} at end on {report['cores']} cores"
    return text


def title(report: Dict[str, Any]) -> str:
    steps = ", ".join(f"{t} {n} steps (eval every {report['eval_every'][t]})" for t, n in report["steps"].items())
    how = "FSDP2" if report.get("frontend") == "fsdp" else "DDP"
    return f"Held-out loss at equal steps, {how} on {report['workers']} gloo ranks, {steps}; {report['network']}"


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table (plain text without rich), one section per task."""
    from .tables import table as new_table

    t = new_table(title=title(report), caption=caption(report))
    t.add_column("task", no_wrap=True)
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    cells = _cells(report)
    previous = None
    for i, (task, row) in enumerate(cells):
        last = i + 1 == len(cells) or cells[i + 1][0] != task
        t.add_row(task if task != previous else "", *row, end_section=last and i + 1 < len(cells))
        previous = task
    return t


def markdown(report: Dict[str, Any]) -> str:
    """The same table in Markdown, for the docs."""
    lines = ["| task | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for task, row in _cells(report, none="—"):
        lines.append(f"| {task} | `{row[0]}` | " + " | ".join(row[1:]) + " |")
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    """Held-out loss against bytes sent per rank (log scale) and against training time, a row per
    task; a line per configuration (mean over seeds) with its min–max band; the baseline's final
    held-out loss (the target) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    results = report["results"]
    fig, axes = plt.subplots(len(results), 2, figsize=(13, 4.3 * len(results)), squeeze=False)
    for (ax_bytes, ax_time), (task, res) in zip(axes, results.items()):  # noqa: B905 (Python 3.9)
        about = report["about"][task]
        styles = iter(["-", "--", "-.", ":"] * 5)
        for i, r in enumerate(sorted(res["rows"], key=lambda r: r["config"] == res["baseline"])):
            c = r["curve"]
            base = r["config"] == res["baseline"]
            style = dict(color="black", linewidth=2.8, alpha=0.5, zorder=10) if base else dict(
                color=f"C{i}", linestyle=next(styles), linewidth=1.4, zorder=3)
            pts = [k for k, v in enumerate(c["loss_mean"]) if v is not None]
            if not pts:
                continue
            mean = [c["loss_mean"][k] for k in pts]
            lo = [c["loss_min"][k] for k in pts]
            hi = [c["loss_max"][k] for k in pts]
            sent = [(c["sent_bytes_mean"][k] or 0) / 1e6 for k in pts]
            times = [c["time_s_mean"][k] or 0 for k in pts]
            pos = [k for k, s in enumerate(sent) if s > 0]  # log axis: the point before any byte is left out
            label = r["config"]
            ax_bytes.plot([sent[k] for k in pos], [mean[k] for k in pos], marker="o", markersize=3, label=label,
                          **style)
            ax_bytes.fill_between([sent[k] for k in pos], [lo[k] for k in pos], [hi[k] for k in pos],
                                  color=style["color"], alpha=0.12, linewidth=0)
            ax_time.plot(times, mean, marker="o", markersize=3, label=label, **style)
            ax_time.fill_between(times, lo, hi, color=style["color"], alpha=0.12, linewidth=0)
        targets = [v for v in res["targets"].values() if v is not None]
        for ax in (ax_bytes, ax_time):
            if targets:
                ax.axhline(statistics.fmean(targets), color="grey", linestyle=":", linewidth=1)
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
            # label every minor tick only within a decade; over several, 2 and 5 of each
            minor = LogLocator(subs="all" if high < 10 * low else (2.0, 5.0))
            ax.yaxis.set_minor_locator(minor)
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        unit = about["unit"]
        ax_bytes.set(xscale="log", xlabel="MB sent per rank (cumulative, log scale)", ylabel=f"held-out loss ({unit})",
                     title=f"{task}: held-out loss against bytes sent")
        ax_time.set(xlabel="training time (s, evaluation excluded)", ylabel=f"held-out loss ({unit})",
                    title=f"{task}: held-out loss against training time")
    fig.suptitle(
        f"{report['workers']} gloo ranks, mean over {len(report['seeds'])} seed(s) (band: min–max); dotted: the"
        f" baseline's final held-out loss\n{report['network']}", fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
