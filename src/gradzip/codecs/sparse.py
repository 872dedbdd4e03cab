"""Sparsification codecs: top-k, random-k, threshold, DGC, gradient dropping and AdaComp.

Four kinds of selection, from exact to adaptive:

- ``topk``: exactly the k largest magnitudes (a full selection, payload of fixed size).
- ``dgc``: a threshold estimated from a random sample, then capped: if the threshold let through
  more than ``2k`` values, the exact top-k of those is kept (payload of at most ``2k`` values).
- ``graddrop``: the sampled threshold alone, no cap: about ``ratio·numel`` values in expectation,
  exactly how many depends on the sample and the data.
- ``threshold``: a fixed absolute threshold, no estimate at all; ``adaq`` (AdaComp): a local
  threshold per bin of 50 values, plus ternary quantisation of what is sent.

The data-dependent ones declare ``fixed_size = False``: the all-gather collective then exchanges
payload lengths first. They find their indices with ``torch.nonzero``, which on CUDA waits for
the device once (the output size must be known); there is no other host sync but, in a fused
group, DGC's question whether any member is over its cap and top-k's whether every member has
enough candidates (one read each, once the device has been waited for).

Every one of them sends a fused group of gradients as one payload: threshold's selection is a
value's own; top-k, random-k, DGC, gradient dropping and AdaComp take the group by its parts
(each member's ``k``, draws, sampled threshold or scale its own).

No payload is larger than the raw tensor: where values and indices would be (a dense selection,
a tiny tensor), the same two tensors carry the selected values densely instead — every value in
the input dtype, zeros where none was selected, and no indices. Values (either form) go in
:attr:`Meta.wire <gradzip.codecs.base.Meta.wire>` where the engine gives one: a 16-bit gradient's
own width where the input is its fp32 compensation, so error feedback does not double the bytes
of a 16-bit gradient. The decoder tells the formats
apart by the lengths alone (``len(indices) == 0`` and ``len(values) == numel``), so each rank may
pick its own, and the all-gather keeps the tensor count and dtypes it expects.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import fused, pack_bits, packed_bytes, shared_generator, unpack_bits
from .base import (
    PART_ALIGN,
    SEED,
    Codec,
    Meta,
    Option,
    Payload,
    all_finite,
    as_wire,
    element_size,
    empty_result,
    float_in,
    int_in,
    layout_cache,
    part_fill,
    part_spans,
    part_units,
    raw_bytes,
    saturate,
    stats_nonfinite,
)
from .quantize import _fp32
from .registry import register_codec

RATIO = Option(0.01, float_in(0.0, 1.0, lo_open=True), "a float in (0, 1]", "fraction of values sent")
SAMPLE_RATIO = Option(
    0.01, float_in(0.0, 1.0, lo_open=True), "a float in (0, 1]", "fraction of |x| sampled to estimate the threshold"
)


def _k(numel: int, ratio: float) -> int:
    return max(1, min(numel, math.ceil(numel * ratio)))


def _scatter(values: torch.Tensor, idx: torch.Tensor, numel: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A dense tensor of ``numel`` zeros with ``values`` at ``idx``: ``out`` (flat, ``numel``
    long; the values cast to its dtype) where given, else a new one of the values' dtype."""
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    else:
        out.zero_()
    return out.index_copy_(0, idx.long(), values.to(out.dtype))


def _is_dense(values: torch.Tensor, idx: torch.Tensor, numel: int) -> bool:
    """Whether a ``[values, indices]`` payload holds every value densely (no indices)."""
    return idx.numel() == 0 and values.numel() == numel


class _ValuesIndices(Codec):
    """Payload ``[values (input dtype, or Meta.wire), int32 indices]``, or the dense form of the same selection
    where that is smaller; decodes by scattering, aggregates by a scatter-add of every rank's
    payload in rank order (the same float sums on every rank)."""

    reencodable = False  # re-selecting from the union of W selections would drop most of it
    raw_fallback = False  # the dense form of the selection instead (see the module docstring)

    @staticmethod
    def _payload(x: torch.Tensor, idx: torch.Tensor, wire: Optional[torch.dtype] = None) -> List[torch.Tensor]:
        """``[x[idx], int32 idx]``, or ``[x with zeros off idx, no indices]`` where that is
        smaller, the values in ``wire`` (:attr:`Meta.wire`) where given."""
        n, m = x.numel(), idx.numel()
        size = (wire or x.dtype).itemsize
        if m * (size + 4) <= n * size:
            return [as_wire(x[idx], wire), idx.to(torch.int32)]
        dense = x if m == n else torch.zeros_like(x).index_copy_(0, idx, x[idx])
        return [as_wire(dense, wire), idx.new_empty(0, dtype=torch.int32)]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        values, idx = tensors
        if _is_dense(values, idx, meta.numel):
            return values
        return _scatter(values, idx, meta.numel)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        # the selected values written straight into ``out`` (zeros elsewhere): no dense tensor
        # of the input's dtype made and then copied (the same values: a cast is exact either way)
        values, idx = tensors
        sparse = not _is_dense(values, idx, meta.numel)
        if sparse and not accumulate and out.is_contiguous() and out.numel() == meta.numel:
            _scatter(values, idx, meta.numel, out.view(-1))
            return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def aggregate(self, payloads: Sequence[Payload]) -> torch.Tensor:
        meta = payloads[0].ctx
        if meta.numel == 0:
            return empty_result(meta)
        out = _sum_payloads(payloads, torch.empty(meta.numel, dtype=torch.float32, device=meta.device))
        return saturate(out.div_(len(payloads)).reshape(meta.shape), meta.dtype)

    def aggregate_into(self, payloads: Sequence[Payload], out: torch.Tensor, mean: bool = True) -> torch.Tensor:
        """:meth:`aggregate` summed straight into the flat fp32 ``out``, for an fp32 gradient:
        the same sums in the same order, no tensor of the group's size made and copied (with
        ``mean`` False the sum, for a caller that scaled the payloads already)."""
        if payloads[0].ctx.dtype != torch.float32:  # (the average rounded to the gradient's dtype first)
            return out.copy_(self.aggregate(payloads).reshape(-1))
        _sum_payloads(payloads, out)
        return out.div_(len(payloads)) if mean else out


def _sum_payloads(payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor:
    """Every rank's values added at their indices (a dense payload whole) into the flat fp32
    ``out``, zeroed first, in rank order: the same float sums on every rank."""
    numel = payloads[0].ctx.numel
    out.zero_()
    for p in payloads:
        values, idx = p.tensors
        if _is_dense(values, idx, numel):
            out.add_(values.reshape(-1).float())
        else:
            out.index_add_(0, idx.long(), values.float())
    return out

@register_codec
class TopK(_ValuesIndices):
    """Top-k sparsification (Aji & Heafield, EMNLP'17; Stich et al., NeurIPS'18).

    Sends the ``k = ceil(ratio * numel)`` values of largest magnitude (in the gradient's dtype)
    and their int32 indices. Biased: use it with error feedback (``memory="residual"``, the
    default), which keeps what was not sent for later steps. Payloads have different indices on
    every rank, so they are all-gathered and scattered into one dense sum.

    Options: ``ratio`` (default 0.01). Wire: ``k * (value bytes + 4)``, or the raw size where
    that is smaller (the dense form: ``k`` close to ``numel``, or a tiny tensor; it depends
    only on ``numel`` and the dtype, so the payload size stays fixed).

    Speed: selecting the k largest takes several passes over the gradient (a radix select on the
    magnitudes' bits: histograms, then the survivors), so encoding cannot run at the speed of a
    copy; on an H100 it reached 11–13% of a device copy (decode, a scatter, 51–56%), on an H200
    9% (54%).

    A fused group on the all-gather is one payload (:attr:`~gradzip.codecs.base.Codec.parts_format`):
    each member's own ``k`` largest (the selection it has alone), their indices in the group,
    one all-gather and one scatter-add a rank. On the CPU the selections are made member by
    member (a radix select each); on an accelerator all at once, in a fixed number of
    operations: candidates above a threshold estimated from a fixed sample of each member,
    sorted once by member and magnitude (the same sets; a member whose candidates fall short
    of its ``k`` sends the group member by member that step).
    """

    name = "topk"
    family = "sparsification"
    paper = "Aji & Heafield, Sparse Communication for Distributed Gradient Descent, EMNLP'17"
    collectives = ("allgather",)
    default_memory = "residual"
    options = {"ratio": RATIO}
    parts_format = True  # a fused group: one payload, each member's selection its own

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        if meta.parts is not None:
            idx = _group_topk(x, meta.parts, self.ratio) if fused.groups_at_once(x.device) else None
            if idx is None:  # member by member (the CPU's way, and where a member has too few candidates)
                picks = [fused.topk(x[a : a + n], _k(n, self.ratio))[1].add_(a)
                         for a, n in part_spans(meta.parts, self.fused_alignment()) if n]
                idx = torch.cat(picks) if picks else torch.empty(0, dtype=torch.int64, device=x.device)
            return self._payload(x, idx, meta.wire)
        _, idx = fused.topk(x, _k(x.numel(), self.ratio))
        return self._payload(x, idx, meta.wire)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return min(_k(numel, self.ratio) * (element_size(dtype) + 4), raw_bytes(numel, dtype))

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the values sent: a NaN or ±inf has the largest magnitude, so each tensor's
        selection holds every one of them, or nothing finite (and the dense form every value),
        and the collective needs no pass over the input for the flag."""
        return stats_nonfinite(payload, 0)


class _TopKPlan:
    """How :func:`_group_topk` samples a fused group (members back to back), made once per
    layout on its device: each member's ``starts`` (with the group's end), ``sizes``, ``ks``
    (its ``k``, 0 for an empty member), a fixed uniform sample of its values (``sample`` and
    the sample's ``member``), the sorted sample's place of each member's candidate threshold
    (``at``: its ``k``-th largest where the sample is the whole member, else the rank that
    leaves about ``2k`` of its values above, so that all of its ``k`` largest are candidates
    unless the sample is far off), and for each of the ``total_k`` values kept its member
    (``kmember``) and its rank in it (``kslot``); on the host ``total_k`` and ``size``."""

    def __init__(self, parts: Tuple[Tuple[str, torch.Size], ...], ratio: float, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0x70C)  # (a fixed sample: only where a threshold falls depends on it)
        starts, sizes, ks, sample, member, at = [], [], [], [], [], []
        slots = total = 0
        for i, (_, shape) in enumerate(parts):
            n = shape.numel()
            k = _k(n, ratio) if n else 0
            s = min(n, max(-(-n // 64), 1024))
            if s == n:  # the whole member: its k-th largest exactly
                sample.append(torch.arange(total, total + n))
                rank = k
            else:
                sample.append(torch.randint(0, n, (s,), generator=gen).add_(total))
                rank = min(s, max(1, -(-2 * k * s // n)))
            member.append(torch.full((s,), i, dtype=torch.long))
            at.append(slots + rank - 1 if n else 0)
            starts.append(total)
            sizes.append(n)
            ks.append(k)
            slots += s
            total += n
        self.size, self.total_k = total, sum(ks)
        self.starts = torch.tensor(starts + [total], dtype=torch.long, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.long, device=device)
        self.ks = torch.tensor(ks, dtype=torch.long, device=device)
        self.sample = torch.cat(sample).to(device)
        self.member = torch.cat(member).to(device)
        self.at = torch.tensor(at, dtype=torch.long, device=device)
        firsts = torch.repeat_interleave(torch.cumsum(self.ks, 0) - self.ks, self.ks, output_size=self.total_k)
        self.kslot = torch.arange(self.total_k, device=device) - firsts
        self.kmember = torch.repeat_interleave(torch.arange(len(parts), device=device), self.ks, output_size=self.total_k)


@layout_cache  # (a group each: the same every step)
def _topk_plan(parts: Tuple[Tuple[str, torch.Size], ...], ratio: float, device: torch.device) -> _TopKPlan:
    return _TopKPlan(parts, ratio, device)


def _group_topk(x: torch.Tensor, parts: Tuple[Tuple[str, torch.Size], ...], ratio: float) -> Optional[torch.Tensor]:
    """Each member's ``k`` largest magnitudes of a fused group (members back to back), in a
    fixed number of operations whatever the members: each member's candidate threshold from a
    fixed sample (one gather and one sort of all the samples, keyed by member and magnitude),
    the candidates at or above it (one ``nonzero``: a device wait), sorted once by member and
    magnitude (stably: ties go to the lowest index, as the radix selects break them), and each
    member's first ``k`` taken. The indices go member by member, the largest first. None where
    some member has fewer than ``k`` candidates (a sample far off, NaN): then member by member."""
    plan = _topk_plan(parts, ratio, x.device)
    if plan.size != x.numel() or plan.total_k == 0 or x.dtype == torch.float64:
        return None  # (fp64: magnitudes equal in fp32 would tie where the radix selects tell them apart)
    mag = _magnitudes(x)
    thresholds = _ranked_magnitudes(plan.member, mag.index_select(0, plan.sample), plan.at)
    # (not below: NaN, the largest magnitude to the radix selects, is a candidate too)
    below = mag < torch.repeat_interleave(thresholds, plan.sizes, output_size=plan.size)
    candidates = torch.nonzero(below.logical_not_()).reshape(-1)
    member = torch.searchsorted(plan.starts, candidates, right=True).sub_(1)
    firsts, counts = _member_counts(candidates, plan.starts)
    if bool((counts < plan.ks).any()):  # (a host read, once the nonzero has waited for the device)
        return None
    order = torch.sort(_descending_by_member(member, mag.index_select(0, candidates)), stable=True).indices
    return candidates.index_select(0, order.index_select(0, firsts.index_select(0, plan.kmember) + plan.kslot))


@register_codec
class RandomK(Codec):
    """Random-k sparsification (Stich et al., Sparsified SGD with Memory, NeurIPS'18).

    Sends ``k = ceil(ratio * numel)`` values at indices drawn (uniformly, with replacement) from a
    generator seeded by (seed, step, tensor name). Every rank draws the same indices, so only the
    values travel and they are summed by a plain all-reduce. Biased unless ``scale=True``
    (each drawn value counts ``numel / k`` times, which makes the estimate exactly unbiased,
    except that a value whose multiple exceeds the dtype's range is decoded as its largest
    finite value); the default error feedback keeps what was not sent.

    Options: ``ratio`` (default 0.01), ``seed``, ``scale`` (default False; with it the default
    memory is ``none``, and error feedback is refused: a residual of ``-(numel/k - 1)`` times
    each drawn value would grow without bound).

    A fused group is one call (:attr:`~gradzip.codecs.base.Codec.parts_format`): on the CPU each
    member's indices are drawn as alone (its name, its size), shifted to its place in the group,
    and the group's values are gathered, summed and scattered once: the bits of one tensor at a
    time. On an accelerator one draw keyed by the group gives every member its own ``k``
    indices, uniform in its own range (one ``rand`` a group, not a generator and a draw a
    member: other indices than alone, drawn alike on every rank, the same distribution).
    """

    name = "randomk"
    family = "sparsification"
    paper = "Stich et al., Sparsified SGD with Memory, NeurIPS'18"
    collectives = ("allreduce", "allgather")
    default_memory = "residual"
    summable = True
    payload_linear = True  # the drawn values: (x / W)[i] is x[i] / W, bit for bit
    options = {
        "ratio": RATIO,
        "seed": SEED,
        "scale": Option(False, lambda v: isinstance(v, bool), "True or False", "rescale by numel/k"),
    }

    parts_format = True  # a fused group: one call, each member's draws its own

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        if self.scale:  # unbiased: it goes without error feedback (see memory_problem)
            self.default_memory = "none"

    def memory_problem(self, memory: str) -> Optional[str]:
        if self.scale and memory != "none":
            return (f"randomk with scale=True cannot take memory={memory!r}: a drawn value counts numel/k times, so "
                    f"error feedback would keep -(numel/k - 1) times it as residual and grow it at every draw; use "
                    f"scale=True without error feedback (memory='none', its default), or error feedback with "
                    f"scale=False")
        return None

    def _indices(self, meta: Meta) -> torch.Tensor:
        idx = meta.extra.get("indices")
        if idx is None:
            if meta.parts is None:
                idx = self._draw(meta.name, meta.step, meta.numel, meta.device)
            elif fused.groups_at_once(meta.device):  # one draw for the group: each member's own k in its own range
                gen = shared_generator(self.seed, meta.step, meta.name, meta.device)
                first, size, _ = _draw_layout(meta.parts, self.ratio, meta.device)
                at = torch.rand(size.numel(), generator=gen, dtype=torch.float64, device=meta.device)
                idx = torch.minimum(at.mul_(size).floor_(), size - 1).long().add_(first)
            else:  # each member's draws as alone, in its place in the group
                spans = part_spans(meta.parts, self.fused_alignment())
                idx = torch.cat([self._draw(name, meta.step, n, meta.device).add_(a)
                                 for (name, _), (a, n) in zip(meta.parts, spans) if n])
            meta.extra["indices"] = idx
        return idx

    def _draw(self, name: str, step: int, numel: int, device: torch.device) -> torch.Tensor:
        """The ``k`` indices of a tensor of ``numel`` values named ``name`` at ``step``, drawn by
        every rank alike."""
        gen = shared_generator(self.seed, step, name, device)
        return torch.randint(0, numel, (_k(numel, self.ratio),), generator=gen, device=device)

    def _scales(self, meta: Meta) -> Optional[torch.Tensor]:
        """With ``scale``, each drawn value's weight ``numel / k`` of its tensor (fp64, a draw
        each) for a fused group; None for one tensor (one weight)."""
        return None if meta.parts is None else _draw_layout(meta.parts, self.ratio, meta.device)[2]

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        return [as_wire(x[self._indices(meta)], meta.wire)]

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        values = tensors[0]
        if self.scale:  # each draw adds x_j * n/k: exactly unbiased, duplicates included
            # in fp64, then saturated: x_j * n/k may exceed the range of the dtype
            wide = torch.zeros(meta.numel, dtype=torch.float64, device=values.device)
            weights = self._scales(meta)  # (each member's own in a group; a product, then the sums)
            weights = meta.numel / values.numel() if weights is None else weights
            wide.index_add_(0, self._indices(meta), values.double() * weights)
            return saturate(wide, values.dtype)
        return _scatter(values, self._indices(meta), meta.numel)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        # the drawn values written straight into ``out``: no temporary as large as the tensor (a
        # value drawn twice is written twice, the same value: as in _decode)
        if not (self.scale or accumulate) and out.is_contiguous() and out.numel() == meta.numel:
            _scatter(tensors[0], self._indices(meta), meta.numel, out.view(-1))
            return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _k(numel, self.ratio) * element_size(dtype)


@layout_cache  # (a group each: the same every step)
def _draw_layout(parts: Tuple[Tuple[str, torch.Size], ...], ratio: float, device: torch.device
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each draw of random-k's fused group, ``k`` a member in the members' order: its member's
    first index in the group (int64) and size (fp64), the range a draw at once takes, and its
    weight ``numel / k`` with ``scale`` (fp64)."""
    spans = [(a, n) for a, n in part_spans(parts, 1) if n]
    counts = torch.tensor([_k(n, ratio) for _, n in spans], dtype=torch.long)
    first = torch.repeat_interleave(torch.tensor([a for a, _ in spans], dtype=torch.long), counts)
    size = torch.repeat_interleave(torch.tensor([float(n) for _, n in spans], dtype=torch.float64), counts)
    return first.to(device), size.to(device), (size / counts.double().repeat_interleave(counts)).to(device)


def _sampled_threshold(x: torch.Tensor, ratio: float, sample_ratio: float, gen: torch.Generator) -> torch.Tensor:
    """0-dim estimate of the ``ratio`` top quantile of |x| (in fp32) from a random sample.

    ``ceil(numel · sample_ratio)`` values are drawn uniformly with replacement from this rank's
    private generator (the whole tensor when that is every element); the threshold is the
    ``ceil(s · ratio)``-th largest sampled magnitude, so about ``ratio · numel`` values reach it.
    Only the sample's magnitudes are made, not the tensor's.
    """
    x = x.reshape(-1)
    n = x.numel()
    s = min(n, math.ceil(n * sample_ratio))
    if s < n:
        x = x[torch.randint(0, n, (s,), generator=gen, device=x.device)]
    return torch.topk(_magnitudes(x), _k(s, ratio), sorted=False).values.min()


class _SamplePlan:
    """How a fused group's members are sampled for their thresholds (:func:`_part_thresholds`),
    made once per layout, on the group's device: per member its first value (``starts``), its
    size (``sizes``, fp64), its number of sample slots (``counts``: its sample's size, or for a
    member sampled whole, which draws nothing, every value of its blocks, its padding zeros
    included, which rank last), whether it is sampled whole (``whole``), where its slots start
    (``firsts``) and the slot of its ``k``-th largest sampled magnitude once the slots are
    sorted by member, largest first (``kth``), its ``k`` (``caps``: DGC's cap is twice it), the
    members' bounds in the group (``bounds``: their starts and its end) and each block's number
    of the member's values (``valid``: the rest of a member's last block is padding, never
    selected); ``slots`` and ``drawn`` (any member sampled, not whole) on the host."""

    def __init__(self, parts: Tuple[Tuple[str, torch.Size], ...], ratio: float, sample_ratio: float,
                 device: torch.device) -> None:
        starts, sizes, counts, whole, kth, caps = [], [], [], [], [], []
        slots = end = 0
        for a, n in part_spans(parts, PART_ALIGN):
            end = a + -(-n // PART_ALIGN) * PART_ALIGN
            s = min(n, math.ceil(n * sample_ratio))
            alone = s == n
            count = -(-n // PART_ALIGN) * PART_ALIGN if alone else s
            starts.append(a)
            sizes.append(float(n))
            counts.append(count)
            whole.append(alone)
            kth.append(slots + _k(s, ratio) - 1 if n else 0)  # (an empty member's: unused, it has no blocks)
            caps.append(_k(n, ratio))
            slots += count
        self.slots, self.drawn = slots, not all(whole)
        self.starts = torch.tensor(starts, dtype=torch.long, device=device)
        self.sizes = torch.tensor(sizes, dtype=torch.float64, device=device)
        self.counts = torch.tensor(counts, dtype=torch.long, device=device)
        self.whole = torch.tensor(whole, dtype=torch.bool, device=device)
        self.firsts = torch.cumsum(self.counts, 0) - self.counts
        self.kth = torch.tensor(kth, dtype=torch.long, device=device)
        self.caps = torch.tensor(caps, dtype=torch.long, device=device)
        self.members = torch.arange(len(counts), dtype=torch.long, device=device)
        self.bounds = torch.tensor(starts + [end], dtype=torch.long, device=device)
        self.valid = part_fill(parts, device)


@layout_cache  # (a group each: the same every step)
def _sample_plan(parts: Tuple[Tuple[str, torch.Size], ...], ratio: float, sample_ratio: float,
                 device: torch.device) -> _SamplePlan:
    return _SamplePlan(parts, ratio, sample_ratio, device)


_MAGNITUDE_BITS = 0x7FFFFFFF  # the bits of |x| as int32 lie in [0, this]: NaN's the largest
_NAN_KEY = 0x7F800001  # every NaN's magnitude key, as in the radix selects: just above +inf


def _descending_by_member(member: torch.Tensor, mag: torch.Tensor) -> torch.Tensor:
    """int64 keys that sort values by member (ascending), then by magnitude, the largest first:
    the member in the high word, the fp32 magnitude's bits (order-preserving for |x| ≥ 0, every
    NaN one key above +inf, as the radix selects rank it) subtracted from their maximum in the
    low word."""
    return (member << 32) | (_MAGNITUDE_BITS - mag.contiguous().view(torch.int32).long().clamp_(max=_NAN_KEY))


def _ranked_magnitudes(member: torch.Tensor, mag: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The magnitudes ``mag`` (fp32, each of its ``member``) at places ``at`` once sorted by
    member and magnitude, the largest first (one sort of their keys): each member's ``k``-th
    largest, where ``at`` is its first place plus ``k - 1``."""
    keys = torch.sort(_descending_by_member(member, mag)).values
    return (_MAGNITUDE_BITS - (keys.index_select(0, at) & 0xFFFFFFFF)).to(torch.int32).view(torch.float32)


def _magnitudes(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32."""
    return x.float().abs()


def _selected(x: torch.Tensor, threshold: float = 0.0,
              per_block: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, most: Optional[int] = None) -> Any:
    """The ascending indices of the values whose magnitude in fp32 reaches ``threshold`` (an
    fp32 value), or with ``per_block`` = (thresholds, valid) their block of :data:`PART_ALIGN`
    values' threshold (fp32) among its first ``valid`` (int32) values, the rest of a fused
    group's block being padding (:func:`fused.select_magnitudes
    <gradzip.kernels.fused.select_magnitudes>`: one device wait, the size is the data's); None
    where there are more than ``most``."""
    return fused.select_magnitudes(x, threshold, *(per_block or (None, None)), span=PART_ALIGN, most=most)


def _sparse_most(x: torch.Tensor, wire: Optional[torch.dtype] = None) -> int:
    """The most values :meth:`_ValuesIndices._payload` sends with their indices (in ``wire``
    where given, :attr:`Meta.wire`): beyond, the dense form is smaller."""
    size = (wire or x.dtype).itemsize
    return x.numel() * size // (size + 4)


def _kept(x: torch.Tensor, threshold: float) -> torch.Tensor:
    """The flat ``x`` with zeros where its magnitude in fp32 is below ``threshold`` (or NaN): the
    dense payload of :func:`_selected`'s indices, a piece at a time on the CPU."""
    out = torch.empty_like(x)
    step = fused.piece_length(x)
    for a in range(0, x.numel(), step):
        piece = x[a : a + step]
        torch.where(_magnitudes(piece) >= threshold, piece, torch.zeros((), dtype=x.dtype, device=x.device),
                    out=out[a : a + step])
    return out


def _part_thresholds(x: torch.Tensor, parts: Tuple[Tuple[str, torch.Size], ...], ratio: float,
                     sample_ratio: float, gen: torch.Generator) -> torch.Tensor:
    """Each member's :func:`_sampled_threshold` (fp32, one a member) for a fused group ``x``
    (members on blocks of :data:`PART_ALIGN`), in a fixed number of operations whatever the
    members: every member's sample drawn by one ``rand`` (uniform indices in its own range, as
    alone), the sampled magnitudes sorted once by member and magnitude, and each member's
    ``k``-th largest read at its place."""
    plan = _sample_plan(parts, ratio, sample_ratio, x.device)
    member = torch.repeat_interleave(plan.members, plan.counts, output_size=plan.slots)
    first = plan.starts.index_select(0, member)
    slot = torch.arange(plan.slots, device=x.device) - plan.firsts.index_select(0, member)
    if plan.drawn:  # a uniform index in the member's range (the member's whole blocks where it is sampled whole)
        at = torch.rand(plan.slots, generator=gen, dtype=torch.float64, device=x.device)
        size = plan.sizes.index_select(0, member)
        drawn = torch.minimum(at.mul_(size).floor_(), size.sub_(1), out=at).long()
        slot = torch.where(plan.whole.index_select(0, member), slot, drawn)
    first += slot  # (every member sampled whole: its values in turn)
    return _ranked_magnitudes(member, _magnitudes(x.index_select(0, first)), plan.kth)


def _part_selection(x: torch.Tensor, parts: Tuple[Tuple[str, torch.Size], ...], ratio: float,
                    sample_ratio: float, gen: torch.Generator) -> torch.Tensor:
    """The indices of a fused group's values whose magnitudes reach their member's sampled
    threshold (ascending; :func:`_selected`), never its padding (sent where a threshold is 0)."""
    thresholds = _part_thresholds(x, parts, ratio, sample_ratio, gen)
    thresholds = thresholds.index_select(0, part_units(parts, 0, x.device).of_block)
    return _selected(x, per_block=(thresholds, _sample_plan(parts, ratio, sample_ratio, x.device).valid))


def _member_counts(idx: torch.Tensor, bounds: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ascending indices ``idx`` into a group whose members lie between ``bounds``: where
    each member's run of them starts in ``idx`` and how many it has (on the device, no host read)."""
    firsts = torch.searchsorted(idx, bounds)
    return firsts[:-1], firsts.diff()


def _upper_bound(numel: int, dtype: torch.dtype) -> int:
    """Every value with its index, or the dense form where that is smaller: the raw size."""
    return min(numel * (element_size(dtype) + 4), raw_bytes(numel, dtype))


@register_codec
class Threshold(_ValuesIndices):
    """Threshold sparsification (Dutta et al., On the Discrepancy between the Theoretical Analysis
    and Practical Implementations of Compressed Communication for Distributed Deep Learning,
    AAAI'20; the ``Threshold`` compressor of GRACE, Xu et al., ICDCS'21).

    Sends every value with ``|x| ≥ threshold`` (in the gradient's dtype) and its int32 index. The
    threshold is absolute, so how much is sent depends on the gradient's scale: 0.01 suits
    gradients whose typical entries are around 1e-3; tune it to the model. What is not sent
    waits in the error-feedback memory (default ``residual``) until it grows past the threshold.

    Options: ``threshold`` (default 0.01, ≥ 0). Wire: ``m · (value bytes + 4)`` for the ``m``
    values that pass, data-dependent (``fixed_size = False``), or the raw size when that is
    smaller (the dense form, when more than ``value bytes / (value bytes + 4)`` of the values
    pass); ``wire_bytes`` is the upper bound, the raw size. Collective: ``allgather``
    (scatter-added).

    Speed on CUDA: the values above the threshold are counted, then gathered (a data-dependent
    size). An H200 encoded at 11% and decoded at 79% of a device copy (``gradzip bench codecs
    --device cuda --numel 67108864``, each call's host work included) when the selection was
    torch's ``abs``, comparison and ``nonzero``; it is now one Triton kernel's two passes (not
    yet timed on a GPU). Fused groups (a value
    is sent by its own magnitude: :meth:`fusion_block` 1) take one selection and one
    all-gather a group.
    """

    name = "threshold"
    family = "sparsification"
    paper = (
        "Dutta et al., On the Discrepancy between the Theoretical Analysis and Practical Implementations "
        "of Compressed Communication for Distributed Deep Learning, AAAI'20"
    )
    collectives = ("allgather",)
    default_memory = "residual"
    fixed_size = False
    options = {
        "threshold": Option(0.01, float_in(0.0, math.inf, hi_open=True), "a finite non-negative float",
                            "send values with |x| >= threshold"),
    }

    records_fusion = False  # fused later: its older checkpoints hold no ``fusion``

    def fusion_block(self) -> int:
        """A value is sent by its own magnitude against a threshold every rank shares: a group
        is one selection, one payload and one all-gather, each member's values those it sends
        alone (one payload for the group is dense or sparse as a whole; the values are the same
        either way)."""
        return 1

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        # where more values pass than the sparse form can hold (a threshold below the gradients'
        # scale), the dense one, made without indices of nearly every value
        x, threshold = x.reshape(-1), _fp32(self.threshold)
        idx = _selected(x, threshold, most=_sparse_most(x, meta.wire))  # CUDA: one device wait
        if idx is None:
            return [as_wire(_kept(x, threshold), meta.wire), x.new_empty(0, dtype=torch.int32)]
        return self._payload(x, idx, meta.wire)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _upper_bound(numel, dtype)


@register_codec
class DGC(_ValuesIndices):
    """Deep Gradient Compression (Lin et al., Deep Gradient Compression: Reducing the
    Communication Bandwidth for Distributed Training, ICLR'18).

    Selection as in the paper's implementation: a threshold is estimated from a random sample of
    ``sample_ratio`` of the magnitudes (drawn from this rank's private generator; the whole
    tensor when ``sample_ratio=1``) as their top-``ratio`` quantile, and every value with
    ``|x| ≥ threshold`` is taken. If that lets through more than ``2k`` values
    (``k = ceil(ratio · numel)``), the exact top-k of them is kept instead; so a payload holds at
    most ``2k`` values (unlike ``graddrop``, which has no cap, and ``topk``, which always sorts
    the whole tensor for exactly k). Fewer than k values may be sent when the sample
    over-estimates the threshold; the memory keeps the rest.

    The rest of DGC lives in the ``dgc`` memory (the default): momentum correction, momentum
    factor masking and local gradient clipping (``memory_options={"momentum": 0.9,
    "clip_norm": None}``). Use plain SGD without optimizer momentum with it: the memory already
    accumulates momentum. The paper's warm-up (sparsity ramped up over the first epochs) is a
    schedule of ``ratio``, not part of the codec: :func:`gradzip.register` ramps DGC by default
    (``ramp``: 25 %, 6.25 %, ... of the values over its first 100 compressed steps; ``ramp=0``
    starts at ``ratio``).

    Options: ``ratio`` (default 0.001, the paper's 99.9 % sparsity), ``sample_ratio`` (default
    0.01), ``seed``. Wire: ``m · (value bytes + 4)`` for the ``m ≤ 2k`` values sent
    (``fixed_size = False``), or the raw size where that is smaller (the dense form);
    ``wire_bytes`` gives the bound ``min(numel, 2k) · (value bytes + 4)``, at most the raw size.
    Collective: ``allgather`` (scatter-added).

    Speed on CUDA: a sampled threshold, then a count and a gather (a data-dependent size). An
    H200 encoded at 21% and decoded at 59% of a device copy (``gradzip bench codecs --device
    cuda --numel 67108864``, each call's host work included).

    A fused group is one payload (:attr:`~gradzip.codecs.base.Codec.parts_format`; members on
    blocks of 256 values): each member's threshold from its own sample (its size, its range),
    all drawn at once and sorted once by member, one selection, and each member over its own
    cap cut to its own ``k`` by one sort of the selection (one host read, after the
    selection's device wait, tells whether any is over). The draws are the group's, so the
    selection differs from one tensor at a time; with ``sample_ratio=1`` it is the same.
    """

    name = "dgc"
    family = "sparsification"
    paper = "Lin et al., Deep Gradient Compression: Reducing the Communication Bandwidth for Distributed Training, ICLR'18"
    collectives = ("allgather",)
    default_memory = "dgc"
    fixed_size = False
    stochastic = True  # the sample differs per rank and step (selection only; values as they are, or in Meta.wire)
    options = {
        "ratio": Option(0.001, float_in(0.0, 1.0, lo_open=True), "a float in (0, 1]", "fraction of values sent"),
        "sample_ratio": SAMPLE_RATIO,
        "seed": SEED,
    }

    parts_format = True  # a fused group: one payload, each member's threshold and cap its own

    def fused_alignment(self) -> int:
        return PART_ALIGN

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        if meta.parts is not None:
            idx = _part_selection(x, meta.parts, self.ratio, self.sample_ratio, self._generator(x.device))
            return self._payload(x, self._capped(x, idx, meta.parts), meta.wire)
        # (a piece at a time on the CPU: no magnitudes of the tensor's size; the threshold read
        # on the host, as the selection reads its count: see _selected)
        x = x.reshape(-1)
        idx = _selected(x, float(_sampled_threshold(x, self.ratio, self.sample_ratio, self._generator(x.device))))
        k = _k(x.numel(), self.ratio)
        if idx.numel() > 2 * k:  # the size is known on the host once the selection has returned
            idx = idx[torch.topk(_magnitudes(x.index_select(0, idx)), k, sorted=False).indices]
        return self._payload(x, idx, meta.wire)

    def _capped(self, x: torch.Tensor, idx: torch.Tensor, parts: Tuple[Tuple[str, torch.Size], ...]) -> torch.Tensor:
        """A group's selection with each member that let through more than ``2k`` of its values
        cut to its ``k`` largest of them: the selected values sorted once by member and
        magnitude, each member's first ``k`` taken. One host read after the selection's own
        device wait (whether any member is over; where one is, how many are kept)."""
        plan = _sample_plan(parts, self.ratio, self.sample_ratio, x.device)
        firsts, counts = _member_counts(idx, plan.bounds)
        kept = torch.where(counts > 2 * plan.caps, plan.caps, counts)
        if not bool((kept < counts).any()):
            return idx
        total = int(kept.sum())  # (the device has been waited for: a copy of one value)
        member = part_units(parts, 0, x.device).of_block.index_select(0, idx // PART_ALIGN).long()
        # (stably: of equal magnitudes the lowest indices first, on every device)
        order = torch.sort(_descending_by_member(member, _magnitudes(x.index_select(0, idx))), stable=True).indices
        # (sorted by member, each member's run starts where it did: its first ``kept`` are its largest)
        at = torch.repeat_interleave(firsts, kept, output_size=total)
        at += torch.arange(total, device=idx.device) - torch.repeat_interleave(
            torch.cumsum(kept, 0) - kept, kept, output_size=total)
        return idx.index_select(0, order.index_select(0, at))

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return min(min(numel, 2 * _k(numel, self.ratio)) * (element_size(dtype) + 4), raw_bytes(numel, dtype))


@register_codec
class GradDrop(_ValuesIndices):
    """Gradient Dropping (Aji & Heafield, Sparse Communication for Distributed Gradient Descent,
    EMNLP'17), with a sampled threshold as in the ``graddrop`` of HiPress (Bai et al., SOSP'21).

    Drops every value below a threshold chosen so that about ``ratio`` of the values are kept:
    the top-``ratio`` quantile of a random sample of ``sample_ratio`` of the magnitudes (this
    rank's private generator). There is no exact selection: unlike ``topk`` (exactly k values,
    full top-k) and ``dgc`` (capped at 2k by an exact top-k of the over-selection), the number
    sent is ``ratio · numel`` only in expectation and varies with the sample. Error feedback
    (default ``residual``) keeps what was dropped, as in the paper.

    Options: ``ratio`` (default 0.01, the paper drops 99 %), ``sample_ratio`` (default 0.01),
    ``seed``. Wire: ``m · (value bytes + 4)`` for the ``m`` values kept, data-dependent
    (``fixed_size = False``), or the raw size where that is smaller (the dense form);
    ``wire_bytes`` is the bound, the raw size.
    Collective: ``allgather`` (scatter-added).

    Speed on CUDA: a sampled threshold, then a count and a gather (a data-dependent size). An
    H200 encoded at 22% and decoded at 57% of a device copy (``gradzip bench codecs --device
    cuda --numel 67108864``, each call's host work included).

    A fused group is one payload, each member's threshold from its own sample, as ``dgc``'s
    (without the cap).
    """

    name = "graddrop"
    family = "sparsification"
    paper = "Aji & Heafield, Sparse Communication for Distributed Gradient Descent, EMNLP'17"
    collectives = ("allgather",)
    default_memory = "residual"
    fixed_size = False
    stochastic = True  # the sample differs per rank and step (selection only; values as they are, or in Meta.wire)
    options = {"ratio": RATIO, "sample_ratio": SAMPLE_RATIO, "seed": SEED}

    parts_format = True  # a fused group: one payload, each member's threshold its own

    def fused_alignment(self) -> int:
        return PART_ALIGN

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        if meta.parts is not None:
            idx = _part_selection(x, meta.parts, self.ratio, self.sample_ratio, self._generator(x.device))
            return self._payload(x, idx, meta.wire)
        x = x.reshape(-1)  # (as dgc's: selected a piece at a time on the CPU)
        threshold = _sampled_threshold(x, self.ratio, self.sample_ratio, self._generator(x.device))
        return self._payload(x, _selected(x, float(threshold)), meta.wire)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return _upper_bound(numel, dtype)


@register_codec
class AdaComp(Codec):
    """AdaComp, adaptive residual gradient compression (Chen et al., AdaComp: Adaptive Residual
    Gradient Compression for Data-Parallel Distributed Training, AAAI'18).

    From the paper (its Algorithm 1): the codec input ``G`` (the residual plus the new gradient
    ``dW``, i.e. the ``residual`` memory's output) is cut into bins of ``bin_size`` values; each
    bin's ``g_max = max |G|``; an element is sent when ``|H| ≥ g_max`` of its bin, with the
    self-adjusting ``H = G + dW``, so values that the newest gradient pushes up go out early and
    the compression rate follows local activity. The codec does not see ``dW`` by itself; it
    keeps, per tensor name, the residual it left last step (``G − decoded``, what the
    ``residual`` memory with β = γ = 1 stores) and takes ``dW = G − that residual``; under that
    memory, in a flat exchange, it reads the memory's residual instead of keeping a copy
    (:meth:`use_memory`). With another memory this ``dW`` is only an estimate (selection only;
    the result stays correct).
    ``self_adjust=False`` uses ``H = G`` (only each bin's maximum, ties included). Elements with
    ``G = 0`` are never sent. A non-finite input leaves the kept residual unchanged.

    Quantisation ("Q"): sent values become ternary ``±scale`` with one per-tensor fp32
    ``scale = mean |G|`` over the sent values (our choice of the layer-wide scale).

    Wire format (compact: in-bin indices rather than global int32 ones): per bin the
    number of values sent (``num_bins`` counts), each sent value's index inside its bin, both
    uint8 when ``bin_size ≤ 255`` and int16 otherwise, the sign bits of the sent values packed 8
    per byte, and the fp32 scale. About ``m · 9 bits + num_bins · 8 bits + 32`` for ``m`` values
    sent; data-dependent (``fixed_size = False``); ``wire_bytes`` is the bound with every value
    sent, ``1.15 bytes`` per element for ``bin_size = 50`` (below the raw size of fp32 and fp16).
    Where this format would take more bytes than the raw tensor (tiny tensors, small bins on
    16-bit input), the same four tensors carry the decoded values densely instead: no counts,
    no indices, no scale, and the values (input dtype, or :attr:`Meta.wire`) as the bytes of the
    third tensor; the decoder recognises it by the empty counts (a sparse payload has one count
    per bin).
    Note: GRACE's ``adaq`` is a different method (Dryden et al., MLHPC'16); the name is kept.

    Options: ``bin_size`` (default 50, the paper's L_T for convolutions; 500 for fully connected
    layers; 1..32767), ``self_adjust`` (default True). Default memory: ``residual``.
    Collective: ``allgather``; payloads are decoded and averaged.

    Speed on CUDA: per-bin maxima, then a selection against them (a data-dependent size). An
    H200 encoded at 4% and decoded at 14% of a device copy (``gradzip bench codecs --device cuda
    --numel 67108864``, each call's host work included).

    A fused group is one payload (:attr:`~gradzip.codecs.base.Codec.parts_format`): its members
    start on bins, so each keeps the bins and the selection it has alone; the payload carries
    one scale a member (the mean over that member's sent values, by one sum over the sent
    values), and the residuals it keeps stay by name: the bits of one tensor at a time (but
    that one non-finite flag covers the group: a NaN in one member keeps every member's kept
    residual, as it keeps their memory's).
    """

    name = "adaq"
    reencodable = False  # a sparsifier: see _ValuesIndices
    raw_fallback = False  # a dense form of its own (see the docstring)
    tensor_state = "residuals"
    family = "sparsification"
    paper = "Chen et al., AdaComp: Adaptive Residual Gradient Compression for Data-Parallel Distributed Training, AAAI'18"
    collectives = ("allgather",)
    default_memory = "residual"
    fixed_size = False
    options = {
        "bin_size": Option(50, int_in(1, 32767), "an integer in 1..32767", "values per selection bin (L_T)"),
        "self_adjust": Option(True, lambda v: isinstance(v, bool), "True or False", "select on H = G + dW"),
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._residuals: Dict[str, torch.Tensor] = {}  # saved by Codec.state_dict (tensor_state)
        self._index_dtype = torch.uint8 if self.bin_size <= 255 else torch.int16
        self._memory: Any = None  # the residual memory it reads its residuals from (use_memory)

    def use_memory(self, memory: Any) -> None:
        """Under the plain ``residual`` memory (β = γ = 1) the residual it would keep is the
        memory's own, still the last step's when this step's input is encoded: it reads that
        one (no second copy of every gradient), and keeps its own under any other."""
        plain = memory is not None and memory.name == "residual" and memory.beta == 1.0 and memory.gamma == 1.0
        self._memory = memory if plain and self.self_adjust else None
        if self._memory is not None:
            self._residuals.clear()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._memory is not None:  # (saved by a copy of its own: the memory's are restored too)
            self._residuals.clear()

    def _residual(self, name: str) -> Optional[torch.Tensor]:
        source = self._memory.residuals if self._memory is not None else self._residuals
        return source.get(name) if self.self_adjust else None

    def _bins(self, numel: int) -> Tuple[int, int]:
        size = min(self.bin_size, numel)
        return size, -(-numel // size)

    parts_format = True  # a fused group: one payload, a scale and a kept residual a member

    def fused_alignment(self) -> int:
        """Each member of a fused group starts on a bin: its bins are those it has alone (the
        last one's zero padding is never sent), so only its scale needs its parts."""
        return self.bin_size

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        g = x.float().reshape(-1)
        n = g.numel()
        size, nb = self._bins(n)
        prev = self._residual(meta.name) if meta.parts is None else self._group_residual(meta.parts, g)
        if prev is not None and prev.numel() == n:
            prev = prev.reshape(-1).to(g.device)
        else:
            prev = None
        idx, counts = self._selection(g, prev, size)  # ascending, so bin-major; CUDA: one wait
        m = idx.numel()
        local = torch.remainder(idx, size)
        values = g.index_select(0, idx)
        # summed in fp64: an fp32 sum of values near the fp32 maximum would overflow
        if meta.parts is None:
            scale = (values.abs().sum(dtype=torch.float64) / max(m, 1)).float().reshape(1)
            each = scale
        else:  # each member's mean over its own sent values (one sum a member, by the bins' members)
            member = _bin_members(meta.parts, size, g.device).index_select(0, idx // size)
            sums = torch.zeros(len(meta.parts), dtype=torch.float64, device=g.device)
            sums.index_add_(0, member, values.abs().double())
            sent_counts = torch.zeros_like(sums).index_add_(0, member, torch.ones_like(sums[:1]).expand(m))
            scale = (sums / sent_counts.clamp_min_(1)).float()
            each = scale.index_select(0, member)
        nonneg = values >= 0
        width = element_size(self._index_dtype)
        # (the dense form's values: in the gradient's width where given, Meta.wire)
        dense = (nb + m) * width + packed_bytes(m, 1) + 4 * scale.numel() > raw_bytes(n, meta.as_is)
        signed = (nonneg.float() * 2 - 1) * each  # (the values sent, at idx)
        sent = torch.zeros_like(g).index_copy_(0, idx, signed) if dense else None
        if self.self_adjust and self._memory is None:  # (the memory's residual is its own)
            finite = all_finite(g)
            if not fused.groups_at_once(g.device) and bool(finite):  # (the flag read on the host: free)
                kept = g.clone().index_add_(0, idx, signed, alpha=-1)  # g − sent, changed only where sent
            else:  # the flag picks old or new on the device
                old = prev if prev is not None and prev.numel() == n else torch.zeros_like(g)
                if sent is None:
                    sent = torch.zeros_like(g).index_copy_(0, idx, signed)
                kept = torch.where(finite, g - sent, old.reshape(g.shape).to(g.device))
            if meta.parts is None:
                self._residuals[meta.name] = kept
            else:  # by name, views of the group's (checkpoints hold them as the members alone)
                for (name, shape), (a, count) in zip(meta.parts, part_spans(meta.parts, self.bin_size)):
                    self._residuals[name] = kept[a : a + count].view(shape)
        if dense:  # the same values, densely in the input dtype (or Meta.wire), as bytes: see _decode
            empty = idx.new_empty(0, dtype=self._index_dtype)
            raw = saturate(sent, meta.as_is).view(torch.uint8)
            return [empty, empty.clone(), raw, scale.new_empty(0)]
        return [counts.to(self._index_dtype), local.to(self._index_dtype), pack_bits(nonneg.to(torch.uint8), 1), scale]

    def _selection(self, g: torch.Tensor, prev: Optional[torch.Tensor], size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ascending indices of the values of the flat fp32 ``g`` that are sent (``|H| ≥``
        their bin's ``max |G|``, never a zero) and each bin's count of them; ``prev`` the
        residual kept last step (flat), if any (``fused.adacomp_select``: two C passes on the
        CPU, else torch a piece of whole bins at a time)."""
        return fused.adacomp_select(g, prev, size, self.self_adjust)

    def _group_residual(self, parts: Tuple[Tuple[str, torch.Size], ...], g: torch.Tensor) -> Optional[torch.Tensor]:
        """The residuals of a fused group's members where they lie in the group (zeros for a
        member without one, which is what ``dW = G`` means; zeros in the padding): the buffer
        the memory keeps them in where they are its views in this layout, else a copy in."""
        if not self.self_adjust:
            return None
        spans = part_spans(parts, self.bin_size)
        found = [self._residual(name) for name, _ in parts]
        first = found[0]
        base = None if first is None else first._base
        if base is not None and base.numel() == g.numel() and base.device == g.device and all(
            r is not None and r._base is base and r.numel() == n and r.data_ptr() == base.data_ptr() + a * base.element_size()
            for r, (a, n) in zip(found, spans)
        ):
            return base  # (the engine's group residual, or this codec's own from the step before)
        out = torch.zeros_like(g)
        for r, (a, n) in zip(found, spans):
            if r is not None and r.numel() == n:
                out[a : a + n] = r.reshape(-1)
        return out

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        counts, local, signs, scale = tensors
        n = meta.numel
        if counts.numel() == 0:  # the dense form: no bin counts, the values' bytes in place of signs
            return signs.view(meta.as_is).float()
        size, nb = self._bins(n)
        m = local.numel()
        bins = torch.repeat_interleave(torch.arange(nb, device=local.device), counts.long(), output_size=m)
        idx = bins * size + local.long()
        if meta.parts is not None:  # each value with its member's scale
            scale = scale.index_select(0, _bin_members(meta.parts, size, local.device).index_select(0, bins))
        values = unpack_bits(signs, 1, m).float().mul_(2).sub_(1).mul_(scale.float())
        return torch.zeros(n, dtype=torch.float32, device=local.device).index_copy_(0, idx, values)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        width = 1 if self.bin_size <= 255 else 2
        return min((self._bins(numel)[1] + numel) * width + packed_bytes(numel, 1) + 4, raw_bytes(numel, dtype))


@layout_cache  # (a group each: the same every step)
def _bin_members(parts: Tuple[Tuple[str, torch.Size], ...], size: int, device: torch.device) -> torch.Tensor:
    """The member of each bin of ``size`` values of a fused group whose members start on bins (int64)."""
    bins = torch.tensor([-(-shape.numel() // size) for _, shape in parts], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(parts)), bins).to(device)

