"""``gradzip bench models``: DDP steps over the gradient sets of real architectures.

One big tensor flatters a codec. A real step is hundreds of tensors of every size in a handful
of DDP buckets, and the small ones pay fixed costs (a collective round, Python work per tensor,
gloo's latency) that no saving in bytes recovers. So this benchmark runs DDP on modules whose
parameters have the exact names, shapes and order of real models:

- ResNet-50 and ResNet-18 (He et al., 2016), built from a faithful copy of torchvision's
  ``torchvision.models.resnet`` definition on the meta device;
- BERT-base-uncased (Devlin et al., 2019) and GPT-2 small (Radford et al., 2019), generated from
  the Hugging Face transformers configurations ``bert-base-uncased`` and ``gpt2`` with the
  parameter names of ``BertModel`` and ``GPT2LMHeadModel`` (whose ``lm_head`` is tied to
  ``wte``, so it is one tensor);
- ViT-B/16 (Dosovitskiy et al., 2021) as torchvision's ``vit_b_16`` (1000-class head).

Their forward costs next to nothing (``x · ½‖p‖²`` per parameter, so every parameter gets a
dense, non-constant gradient) and a step is DDP's gradient exchange; DDP buckets them itself, as
it would the real model (defaults: 25 MiB buckets, rebuilt after the first step in the order the
gradients arrived, which here is registration order reversed, as in a real backward). The
``resnet18-real`` model runs a real forward and backward on random images instead, so the
exchange overlaps with compute; its time without any communication is measured beside it.

Methods: fp32 DDP (no hook), PyTorch's ``fp16_compress_hook``, gradzip's ``maxmin4`` and any
extra configs (the demo's names or codec specs). Each is warmed up (DDP rebuilds its buckets
after the first step), then timed step by step behind a barrier, each step's time the slowest
rank's. Each row is set against the limits of ``gradzip bench allreduce``: the *wire limit*
(the bytes each rank's link must carry for that collective pattern, at the link rate) and the
*codec limit* (encode+decode CPU time of the model's gradient set, measured in the ranks with
thread CPU clocks in extra untimed steps, spread over the cores the ranks share).
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm.hierarchy import Hierarchical

Shape = Tuple[int, ...]
ParamList = List[Tuple[str, Shape]]


# ---------------------------------------------------------------------------------- ResNet
# A copy of torchvision's ResNet (torchvision/models/resnet.py): same modules, same attribute
# order, hence the same parameter names, shapes and order; forward as there.

def _conv3x3(inp: int, out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inp, out, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(inp: int, out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inp, out, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)  # stride on the 3x3 (ResNet v1.5, as torchvision)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """torchvision's ResNet: ``ResNet(Bottleneck, [3, 4, 6, 3])`` is ResNet-50."""

    def __init__(self, block: Type[Union[BasicBlock, Bottleneck]], layers: Sequence[int], num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, width)


def resnet50(num_classes: int = 1000, width: int = 64) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, width)


def shapes_of(build: Callable[[], nn.Module]) -> ParamList:
    """The parameters of ``build()`` (names, shapes, in order), made on the meta device: no memory."""
    with torch.device("meta"):
        module = build()
    return [(name, tuple(p.shape)) for name, p in module.named_parameters()]


def resnet50_shapes() -> ParamList:
    return shapes_of(resnet50)


def resnet18_shapes() -> ParamList:
    return shapes_of(resnet18)


# ----------------------------------------------------------------------------- transformers
# Generated from the published configurations, with the parameter names (and order) the
# reference implementations register. Linear weights are (out, in); GPT-2's Conv1D ones (in, out).

def _ln(prefix: str, dim: int) -> ParamList:
    return [(f"{prefix}.weight", (dim,)), (f"{prefix}.bias", (dim,))]


def _linear(prefix: str, inp: int, out: int) -> ParamList:
    return [(f"{prefix}.weight", (out, inp)), (f"{prefix}.bias", (out,))]


def bert_shapes(
    vocab: int = 30522, hidden: int = 768, layers: int = 12, intermediate: int = 3072, max_positions: int = 512,
    type_vocab: int = 2, pooler: bool = True,
) -> ParamList:
    """``BertModel`` of Hugging Face transformers; the defaults are ``bert-base-uncased``."""
    out: ParamList = [
        ("embeddings.word_embeddings.weight", (vocab, hidden)),
        ("embeddings.position_embeddings.weight", (max_positions, hidden)),
        ("embeddings.token_type_embeddings.weight", (type_vocab, hidden)),
        *_ln("embeddings.LayerNorm", hidden),
    ]
    for i in range(layers):
        p = f"encoder.layer.{i}"
        out += _linear(f"{p}.attention.self.query", hidden, hidden)
        out += _linear(f"{p}.attention.self.key", hidden, hidden)
        out += _linear(f"{p}.attention.self.value", hidden, hidden)
        out += _linear(f"{p}.attention.output.dense", hidden, hidden)
        out += _ln(f"{p}.attention.output.LayerNorm", hidden)
        out += _linear(f"{p}.intermediate.dense", hidden, intermediate)
        out += _linear(f"{p}.output.dense", intermediate, hidden)
        out += _ln(f"{p}.output.LayerNorm", hidden)
    if pooler:
        out += _linear("pooler.dense", hidden, hidden)
    return out


def gpt2_shapes(vocab: int = 50257, positions: int = 1024, hidden: int = 768, layers: int = 12) -> ParamList:
    """``GPT2LMHeadModel`` of Hugging Face transformers; the defaults are ``gpt2`` (small).

    ``lm_head.weight`` is tied to ``transformer.wte.weight``: one tensor, one gradient.
    """
    out: ParamList = [("transformer.wte.weight", (vocab, hidden)), ("transformer.wpe.weight", (positions, hidden))]
    for i in range(layers):
        p = f"transformer.h.{i}"
        out += _ln(f"{p}.ln_1", hidden)
        out += [(f"{p}.attn.c_attn.weight", (hidden, 3 * hidden)), (f"{p}.attn.c_attn.bias", (3 * hidden,))]
        out += [(f"{p}.attn.c_proj.weight", (hidden, hidden)), (f"{p}.attn.c_proj.bias", (hidden,))]
        out += _ln(f"{p}.ln_2", hidden)
        out += [(f"{p}.mlp.c_fc.weight", (hidden, 4 * hidden)), (f"{p}.mlp.c_fc.bias", (4 * hidden,))]
        out += [(f"{p}.mlp.c_proj.weight", (4 * hidden, hidden)), (f"{p}.mlp.c_proj.bias", (hidden,))]
    out += _ln("transformer.ln_f", hidden)
    return out


def vit_shapes(
    image_size: int = 224, patch: int = 16, hidden: int = 768, layers: int = 12, mlp: int = 3072, classes: int = 1000,
) -> ParamList:
    """torchvision's ``VisionTransformer``; the defaults are ``vit_b_16``.

    The class token is the module's own parameter, so it comes first; attention is
    ``nn.MultiheadAttention`` (one packed in-projection).
    """
    seq = (image_size // patch) ** 2 + 1
    out: ParamList = [
        ("class_token", (1, 1, hidden)),
        ("conv_proj.weight", (hidden, 3, patch, patch)),
        ("conv_proj.bias", (hidden,)),
        ("encoder.pos_embedding", (1, seq, hidden)),
    ]
    for i in range(layers):
        p = f"encoder.layers.encoder_layer_{i}"
        out += _ln(f"{p}.ln_1", hidden)
        out += [(f"{p}.self_attention.in_proj_weight", (3 * hidden, hidden)), (f"{p}.self_attention.in_proj_bias", (3 * hidden,))]
        out += _linear(f"{p}.self_attention.out_proj", hidden, hidden)
        out += _ln(f"{p}.ln_2", hidden)
        out += _linear(f"{p}.mlp.0", hidden, mlp)
        out += _linear(f"{p}.mlp.3", mlp, hidden)
    out += _ln("encoder.ln", hidden)
    out += _linear("heads.head", hidden, classes)
    return out


def numel(shapes: ParamList) -> int:
    n = 0
    for _, shape in shapes:
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


# --------------------------------------------------------------------------------- modules

class _HalfSquaredNorm(torch.autograd.Function):
    """``x · ½‖p‖²`` for a 0-dim ``x``, whose backward writes ``p``'s gradient ``g·x·p`` in one
    pass over ``p`` (autograd's own norm backward takes four: divide, mask the zero norm, scale, copy)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        flat = p.detach().reshape(-1)
        half = 0.5 * torch.dot(flat, flat)
        ctx.save_for_backward(x, p, half)
        return x * half

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, p, half = ctx.saved_tensors
        return (g * half if ctx.needs_input_grad[0] else None), torch.mul(p.detach(), g * x)


class ShapeModel(nn.Module):
    """Parameters with exactly the given names and shapes, and a forward that costs next to nothing.

    ``forward(x)`` is ``x · Σ ½‖p‖²``, so every parameter gets the dense gradient ``x · p`` (as
    random as its initialisation), written in one pass over it: the step is the exchange, not
    the stand-in's backward. Everything is a registered parameter and nothing a buffer: DDP
    would broadcast buffers from rank 0 at every forward.
    """

    def __init__(self, shapes: ParamList, seed: int = 0, std: float = 0.02) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self._ordered: List[nn.Parameter] = []
        for name, shape in shapes:
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]
            param = nn.Parameter(torch.empty(shape).normal_(0.0, std, generator=gen))
            mod.register_parameter(leaf, param)
            self._ordered.append(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # summed in model order, so backward reaches the last parameter first, as a real one does
        total = None
        for p in self._ordered:
            term = _HalfSquaredNorm.apply(x, p)
            total = term if total is None else total + term
        return total


@dataclass(frozen=True)
class ModelSpec:
    """A model of the benchmark: its gradient set (``shapes``) or a real module (``module``).

    ``module`` models train for real on a fixed random batch of ``image`` (per rank) and
    ``classes`` labels; ``shapes`` ones get a :class:`ShapeModel`.
    """

    name: str
    title: str
    source: str
    shapes: Callable[[], ParamList]
    module: Optional[Callable[[], nn.Module]] = None
    image: Tuple[int, int, int, int] = (8, 3, 64, 64)
    classes: int = 1000
    published: Optional[int] = field(default=None, compare=False)  # parameter count of the reference


MODELS: Dict[str, ModelSpec] = {
    "resnet50": ModelSpec("resnet50", "ResNet-50", "torchvision resnet50", resnet50_shapes, published=25_557_032),
    "bert-base": ModelSpec("bert-base", "BERT-base-uncased", "HF transformers bert-base-uncased (BertModel)", bert_shapes, published=109_482_240),
    "gpt2": ModelSpec("gpt2", "GPT-2 small", "HF transformers gpt2 (GPT2LMHeadModel, tied lm_head)", gpt2_shapes, published=124_439_808),
    "vit-b16": ModelSpec("vit-b16", "ViT-B/16", "torchvision vit_b_16", vit_shapes, published=86_567_656),
    "resnet18": ModelSpec("resnet18", "ResNet-18", "torchvision resnet18", resnet18_shapes, published=11_689_512),
    "resnet18-real": ModelSpec(
        "resnet18-real", "ResNet-18, real forward/backward, 8×3×64×64 per rank", "torchvision resnet18",
        resnet18_shapes, module=resnet18, published=11_689_512,
    ),
}
DEFAULT_MODELS = ["resnet50", "bert-base", "gpt2", "vit-b16"]


# --------------------------------------------------------------------------------- methods

BASELINES = ["fp32", "torch-fp16", "maxmin4"]
# PyTorch's PowerSGD hook issues all-reduces from Future callbacks; with several buckets on gloo
# the ranks then disagree on the order and hang or fail (see the demo), so it is not offered.
UNSUPPORTED = {"torch-powersgd": "PyTorch's PowerSGD hook hangs with several DDP buckets on gloo; use gradzip's powersgd"}


def resolve(config: str) -> Dict[str, Any]:
    """A method: one of the demo's config names (``maxmin2``, ``torch-fp16``, ...) or a codec
    spec as in ``bench allreduce`` (``maxmin:bits=8:memory=residual``). ``ValueError`` if neither."""
    from .methods import CONFIGS, describe
    from .micro import check_spec, collective_options

    if config in UNSUPPORTED:
        raise ValueError(f"{config}: {UNSUPPORTED[config]}")
    if config in CONFIGS:
        spec = CONFIGS[config]
        if spec is None:
            return {"method": config, "label": "DDP all-reduce (fp32)", "kind": "fp32"}
        name, opts = spec
        if name.startswith("torch:"):
            return {"method": config, "label": describe(config), "kind": "torch", "hook": name[len("torch:"):]}
        return {"method": config, "label": "gradzip " + describe(config), "kind": "gradzip", "codec": name, "options": dict(opts)}
    name, opts = check_spec(config)  # raises ValueError
    return {
        "method": config, "label": "gradzip " + " ".join([name] + [f"{k}={v}" for k, v in opts.items()]),
        "kind": "gradzip", "codec": name, "options": collective_options(opts),
    }


def methods_for(configs: Sequence[str]) -> List[Dict[str, Any]]:
    """The baselines, then the extra configs (duplicates dropped)."""
    names = list(dict.fromkeys(BASELINES + list(configs)))
    return [resolve(c) for c in names]


# ------------------------------------------------------------------------------ the ranks

def _build(spec: ModelSpec, rank: int, world: int, device: "str | torch.device" = "cpu",
           ) -> Tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The module (same parameters on every rank) and its loss on this rank's fixed input, on ``device``."""
    if spec.module is None:
        module = ShapeModel(spec.shapes(), seed=0).to(device)
        x = torch.tensor(1.0 + rank / world, device=device)  # ranks' gradients differ
        return module, lambda m: m(x)
    torch.manual_seed(0)
    module = spec.module().to(device)
    gen = torch.Generator().manual_seed(1000 + rank)
    images = torch.randn(spec.image, generator=gen).to(device)
    labels = torch.randint(0, spec.classes, (spec.image[0],), generator=gen).to(device)
    return module, lambda m: F.cross_entropy(m(images), labels)


def _timed_steps(step: Callable[[], None], module: nn.Module, steps: int) -> Tuple[List[float], float]:
    """``steps`` steps, each behind a barrier with fresh gradients: the slowest rank's time per
    step, and this rank's median CPU seconds per step (every thread of the process: DDP, gloo,
    gradzip's worker), the work that the ranks' shared cores must do whoever else is waiting."""
    times = torch.zeros(steps, dtype=torch.float64)
    cpu = []
    for i in range(steps):
        module.zero_grad(set_to_none=True)  # as optimizers do by default: gradients are new each step
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        step()
        times[i] = time.perf_counter() - t0
        cpu.append(time.process_time() - c0)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist(), statistics.median(cpu)


def _per_rank(value: float, world: int) -> List[float]:
    mine = torch.tensor([value], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return [t.item() for t in everyone]


def _fp16_cast_cpu_s(module: nn.Module, world: int) -> float:
    """Thread CPU seconds of what ``fp16_compress_hook`` computes on the gradients: cast, scale, cast back."""
    start = time.thread_time()
    for p in module.parameters():
        if p.grad is not None:
            p.grad.copy_(p.grad.to(torch.float16).div_(world))
    return time.thread_time() - start


def _wire(method: Dict[str, Any], module: nn.Module, state: Any, world: int) -> Tuple[int, float]:
    """(payload bytes this rank contributes per step, bytes its link carries per step).

    Ring all-reduce, SRA and the parameter server move about 2(W−1)/W payloads per rank, a ring
    all-gather W−1 (as ``bench allreduce`` counts them). On nodes of L ranks (torchrun's
    ``LOCAL_WORLD_SIZE``) the link is the node's: a ring crosses it once each way (its bytes are
    one rank's), an exchange with every rank sends the share (W−L)/(W−1) of each of the L ranks'
    bytes over it, and a hierarchical one only its compressed inter-node stage.
    """
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    ring = 2 * (world - 1) / world
    raw = sum(p.numel() * 4 for p in module.parameters())
    if method["kind"] == "fp32":
        return raw, ring * raw
    if method["kind"] == "torch":
        return raw // 2, ring * raw / 2
    codec = state.comm.codec
    coll = state.comm.collective
    if isinstance(coll, Hierarchical):  # its inter-node stage, every rank of the node
        factor = coll.sent_per_byte(world) * per_node
    elif per_node > 1 and world > 1 and state.comm.collective_name != "allreduce":
        factor = coll.sent_per_byte(world) * per_node * (world - per_node) / (world - 1)
    else:
        factor = coll.sent_per_byte(world)
    payload, traffic = 0, 0.0
    for name, p in module.named_parameters():
        if _compressed(state, name, p):
            n = codec.wire_bytes(p.numel(), p.dtype, shape=tuple(p.shape))
            payload, traffic = payload + n, traffic + factor * n
        else:  # fused into the bucket's plain fp32 all-reduce
            n = p.numel() * p.element_size()
            payload, traffic = payload + n, traffic + ring * n
    return payload, traffic


def _compressed(state: Any, name: str, p: torch.Tensor) -> bool:
    """Whether the hook compressed ``p`` in the last step: eligible (the filter), in a group of
    the plan (a planner may leave a group plain) and past the warm-up (whose steps go dense)."""
    past_warmup = state.step > state.config.warmup  # (the last step run was step - 1)
    return past_warmup and state.compresses(name, p)


def _bench_method(spec: ModelSpec, method: Dict[str, Any], rank: int, world: int, steps: int, warmup: int, probe: int) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    import gradzip
    from gradzip.comm.base import measure_cpu_time

    module, loss_of = _build(spec, rank, world)
    # every rank built the same parameters from one seed: no initial broadcast needed
    ddp = DistributedDataParallel(module, init_sync=False)
    state = None
    if method["kind"] == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, method["hook"]))
    elif method["kind"] == "gradzip":
        started = time.perf_counter()
        state = gradzip.register(ddp, method["codec"], **method["options"])
        register_s = time.perf_counter() - started  # the settings check and, planned, the calibration

    def step() -> None:
        loss_of(ddp).backward()

    try:
        _timed_steps(step, module, warmup)  # DDP rebuilds its buckets after the first step
        if state is not None:
            state.comm.metrics.reset()
        times, cpu_step = _timed_steps(step, module, steps)
        timed = state.stats() if state is not None else {}
        measured_wire = timed["wire_bytes"] / steps if state is not None else None
        # backward's end waiting for gradzip's exchanges, per step (the part not overlapped)
        exposed = timed["exposed_s"] / steps if "exposed_s" in timed else None
        payload, traffic = _wire(method, module, state, world)
        cpu = 0.0
        if method["kind"] == "torch" and method["hook"] == "fp16_compress_hook":
            cpu = statistics.median(_fp16_cast_cpu_s(module, world) for _ in range(probe))
        elif state is not None:  # thread CPU clocks only in untimed steps: reading them is slow here
            measure_cpu_time(True)
            try:
                state.comm.metrics.reset()
                _timed_steps(step, module, probe)
                stats = state.stats()
                # absent when no exchange went through the codec (a plan left wholly plain)
                cpu = (stats.get("encode_cpu_s", 0.0) + stats.get("decode_cpu_s", 0.0)) / probe
            finally:
                measure_cpu_time(False)
        logged = ddp._get_ddp_logging_data()
        buckets = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes") or "")
        row = {
            "method": method["method"], "label": method["label"], "times_s": times, "cpu_s": _per_rank(cpu_step, world),
            "wire_bytes": payload, "traffic_bytes": traffic, "codec_cpu_s": _per_rank(cpu, world),
            "bucket_bytes": [int(b) for b in buckets.split(",") if b.strip()],  # DDP's buckets after the rebuild
        }
        if state is not None:
            row["measured_wire_bytes"] = measured_wire
            row["collective"] = state.comm.collective_name
            row["compressed_tensors"] = sum(1 for n, p in module.named_parameters() if _compressed(state, n, p))
            row["exposed_s"] = exposed
            row["register_s"] = register_s
            if state.costs is not None:  # planned: decisions, predicted and measured per group
                row["plan"] = state.plan()
        else:
            row["collective"] = "torch"
        return row
    finally:
        if state is not None:
            state.close()
        del ddp, module, state  # before collecting: the next method needs the memory
        gc.collect()


def _compute_only(spec: ModelSpec, rank: int, world: int, steps: int, warmup: int) -> Tuple[List[float], List[float]]:
    """Forward+backward without DDP or any communication, all ranks at once (they share the cores)."""
    module, loss_of = _build(spec, rank, world)

    def step() -> None:
        loss_of(module).backward()

    try:
        _timed_steps(step, module, warmup)
        times, cpu = _timed_steps(step, module, steps)
        return times, _per_rank(cpu, world)
    finally:
        del module
        gc.collect()


def _round_trip_s(repeats: int = 20) -> float:
    """Median time of an all-reduce of one value: what every extra collective round costs at least."""
    one = torch.zeros(1)
    times = torch.zeros(repeats, dtype=torch.float64)
    dist.all_reduce(one)
    for i in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(one)
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def bench_worker(
    rank: int, world: int, specs: Sequence[ModelSpec], methods: Sequence[Dict[str, Any]], steps: int, warmup: int, probe: int,
) -> Dict[str, Any]:
    """One rank: every model, every method in turn (same order on every rank)."""
    out = []
    latency = _round_trip_s()
    for spec in specs:
        shapes = spec.shapes()
        model = {
            "model": spec.name, "title": spec.title, "source": spec.source, "real_compute": spec.module is not None,
            "tensors": len(shapes), "numel": numel(shapes), "raw_bytes": 4 * numel(shapes),
        }
        model["compute_times_s"], model["compute_cpu_s"] = _compute_only(spec, rank, world, steps, warmup)
        if spec.module is not None:
            model["input"] = list(spec.image)
        model["rows"] = rows = []
        for method in methods:
            row = _bench_method(spec, method, rank, world, steps, warmup, probe)
            rows.append(row)
            if rank == 0:
                print(f"  {spec.name:>14} {method['method']:<20} {statistics.median(row['times_s']):8.3f} s/step",
                      file=sys.stderr, flush=True)
        model["buckets"] = len(rows[0]["bucket_bytes"])  # fp32 DDP's, the same for every method
        out.append(model)
    return {"models": out, "round_trip_s": latency}


# ------------------------------------------------------------------------------ the parent

def _finish(model: Dict[str, Any], world: int, link_bps: Optional[float], cores: int) -> None:
    """Medians, ratios and limits of one model's rows."""
    from .micro import codec_limit

    model["compute_s"] = statistics.median(model["compute_times_s"])
    model["compute_cpu_time_s"] = codec_limit(model["compute_cpu_s"], cores)
    rows = model["rows"]
    med = {r["method"]: statistics.median(r["times_s"]) for r in rows}
    for r in rows:
        m = med[r["method"]]
        r.update(
            median_s=m, min_s=min(r["times_s"]), max_s=max(r["times_s"]), steps_per_s=1 / m,
            vs_fp32=med["fp32"] / m if "fp32" in med else None,
            vs_fp16=med["torch-fp16"] / m if "torch-fp16" in med else None,
            ratio=model["raw_bytes"] / r["wire_bytes"],
        )
        r["wire_limit_s"] = r["traffic_bytes"] * 8 / link_bps if link_bps else None
        r["codec_limit_s"] = codec_limit(r["codec_cpu_s"], cores)
        # all the step's CPU work on the shared cores, waiting on sockets included: not a limit of
        # the method alone, but where it approaches the step's time the step is CPU-bound here
        r["cpu_time_s"] = codec_limit(r["cpu_s"], cores)
        limit = max(r["wire_limit_s"] or 0.0, r["codec_limit_s"])
        r["limit_s"] = limit or None
        r["vs_limit"] = m / limit if limit else None


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_models(
    models: Sequence[Union[str, ModelSpec]] = DEFAULT_MODELS, configs: Sequence[str] = (), workers: int = 4,
    rate: Optional[str] = "1gbit", steps: int = 5, warmup: int = 2, probe: int = 1, json_path: Optional[str] = None,
    timeout_s: float = 300, ranks_per_node: int = 1,
) -> Dict[str, Any]:
    """Run every model × method on ``workers`` local ranks; return (and optionally save) the report.

    With ``rate`` the ranks sit on an emulated cluster with links of that rate; where one cannot
    be built the report's ``fallback`` says why and the ranks use loopback. ``ranks_per_node``:
    ranks per node (``workers`` must be a multiple), which share its namespace and its link
    and are told their node as torchrun tells them.
    """
    from ..comm.launch import spawn_local
    from . import cluster, write_json
    from .micro import usable_cores

    if steps < 1 or warmup < 1 or probe < 1:
        raise ValueError("steps, warmup and probe must be at least 1 (DDP's first step rebuilds its buckets)")
    if workers % ranks_per_node:
        raise ValueError(f"workers ({workers}) must be a multiple of ranks_per_node ({ranks_per_node})")
    nodes = workers // ranks_per_node
    specs = [MODELS[m] if isinstance(m, str) else m for m in models]
    methods = methods_for(configs)
    cores = usable_cores()
    report: Dict[str, Any] = {
        "workers": workers, "rate": rate, "network": "loopback", "cores": cores, "steps": steps, "warmup": warmup,
        "methods": [m["method"] for m in methods], "fallback": None, "ranks_per_node": ranks_per_node,
    }
    t0 = time.perf_counter()
    load_start = _loadavg()
    with contextlib.ExitStack() as stack:
        emu = None
        if rate:
            reason = cluster.available()
            if reason is None:
                try:
                    emu = stack.enter_context(
                        cluster.EmulatedCluster(nodes, rate, prefix=cluster.own_prefix("b"), ranks_per_node=ranks_per_node)
                    )
                except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                    detail = getattr(exc, "stderr", None) or exc
                    reason = f"building it failed: {str(detail).strip()}"
            if emu is None:
                report["fallback"] = f"no emulated {rate} cluster ({reason}); running on plain loopback"
                report["network"] = f"loopback (no emulation: {reason})"
                print(f"gradzip bench models: {report['fallback']}", file=sys.stderr, flush=True)
            else:
                report["network"] = emu.describe()
        results = spawn_local(
            bench_worker, workers, specs, methods, steps, warmup, probe, cluster=emu, timeout_s=timeout_s,
            ranks_per_node=ranks_per_node if ranks_per_node > 1 else None,
        )
    link_bps = cluster.parse_rate(rate) if rate and report["fallback"] is None else None
    for model in results["models"]:
        _finish(model, workers, link_bps, cores)
    report["round_trip_s"] = results["round_trip_s"]  # a one-value all-reduce: the floor of every round
    report["models"] = results["models"]
    report["wall_s"] = time.perf_counter() - t0
    report["loadavg"] = [load_start, _loadavg()]  # the machine's 1-minute load at start and end: it may be shared
    return write_json(report, json_path)


def _context(report: Dict[str, Any]) -> str:
    """The run's one-value all-reduce time and the machine's load (it may be shared)."""
    out = ""
    if report.get("round_trip_s") is not None:
        out += f"; one-value all-reduce: {report['round_trip_s'] * 1e3:.2f} ms"
    load = report.get("loadavg") or [None, None]
    if None not in load:
        out += f"; machine load (1 min) {load[0]:.1f} at start, {load[1]:.1f} at end on {report['cores']} cores"
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}" if n >= 1e7 else f"{n / 1e6:.2f}"


COLUMNS = (
    "model", "method", "s/step", "min–max", "steps/s", "vs fp32", "vs fp16", "MB/rank", "wire lim s", "codec lim s",
    "× limit", "CPU s", "exposed s",
)


def _cells(report: Dict[str, Any], none: str = "-", one_cell: bool = False) -> List[List[str]]:
    """Every row of the table as text: per model a compute-only row, then one per method.

    The model's name and size go down its first column, a line per row (``one_cell``: all in the
    first), so the table stays narrow enough for a terminal.
    """
    def num(x: Optional[float], fmt: str) -> str:
        return none if not x else format(x, fmt)

    out = []
    for model in report["models"]:
        about = [f"{model['tensors']} tensors", f"{model['numel'] / 1e6:.1f} M values", f"{model.get('buckets', '?')} buckets"]
        n_rows = 1 + len(model["rows"])
        if one_cell:
            names = [f"{model['model']} ({', '.join(about)})"] + [""] * (n_rows - 1)
        else:
            names = ([model["model"]] + about)[:n_rows - 1]
            names.append(", ".join(([model["model"]] + about)[n_rows - 1:]))
            names += [""] * (n_rows - len(names))  # (more methods than lines of the name)
        comp = model["compute_times_s"]
        rows = [[
            "compute only (no DDP)", f"{model['compute_s']:.3f}", f"{min(comp):.3f}–{max(comp):.3f}",
            *[none] * 7, num(model.get("compute_cpu_time_s"), ".3f"), none,
        ]]
        for r in model["rows"]:
            rows.append([
                r["method"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}–{r['max_s']:.3f}", f"{r['steps_per_s']:.2f}",
                num(r["vs_fp32"], ".2f") + ("×" if r["vs_fp32"] else ""),
                num(r["vs_fp16"], ".2f") + ("×" if r["vs_fp16"] else ""),
                _mb(r["wire_bytes"]), num(r["wire_limit_s"], ".3f"), num(r["codec_limit_s"], ".3f"),
                num(r["vs_limit"], ".2f"), num(r.get("cpu_time_s"), ".3f"),
                none if r.get("exposed_s") is None else f"{r['exposed_s']:.3f}",
            ])
        out += [[name] + row for name, row in zip(names, rows)]
    return out


CAPTION = (
    "s/step: median (min–max) of the slowest rank; vs fp32 / vs fp16: speed-up over fp32 DDP and over "
    "PyTorch's fp16_compress_hook; MB/rank: payload bytes each rank contributes per step; "
    "wire limit: bytes each rank's link carries (2(W−1)/W payloads; all-gather W−1) / link rate; "
    "codec limit: encode+decode CPU time, max(busiest rank, all ranks / {cores} cores); "
    "× limit: time / the larger of the two; CPU s: the step's whole CPU time (every thread: DDP, gloo, gradzip, "
    "the network stack's share) taken the same way, the time the shared cores were busy with it; compute only: "
    "forward+backward without DDP, on every rank at once; exposed s: how long backward's end waited for "
    "gradzip's exchanges per step (rank 0; gradzip's methods only)"
)


def table(report: Dict[str, Any]):
    """The report as a ``rich`` table (plain text without rich), one section per model."""
    from .tables import table as new_table

    t = new_table(
        title=f"DDP steps over real models' gradient sets, {report['workers']} gloo ranks, median of {report['steps']} "
        f"after {report['warmup']} warm-up; {report['network']}",
        caption=CAPTION.format(cores=report["cores"]) + _context(report),
    )
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("model", "method") else "right", no_wrap=True)
    cells = _cells(report)
    for i, row in enumerate(cells):
        t.add_row(*row, end_section=i + 1 < len(cells) and cells[i + 1][1].startswith("compute only"))
    return t


def markdown(report: Dict[str, Any]) -> str:
    """The same table in Markdown, for the docs."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in _cells(report, none="—", one_cell=True):
        row = [row[0], row[1] if row[1].startswith("compute only") else f"`{row[1]}`", *row[2:]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
