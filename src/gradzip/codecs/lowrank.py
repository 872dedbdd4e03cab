"""Low-rank codec: PowerSGD."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import shared_generator
from ..kernels.rng import counter_uniform
from .base import (SEED, Codec, Meta, Option, Payload, _narrower, as_wire, element_size, int_in, layout_cache,
                   nonfinite_flag)
from .registry import register_codec


# A column whose part outside the columns before it is below this fraction of its length is
# taken as lying in their span (zero, or too little left for two projections to make it
# orthogonal in fp32); a larger part, rounding noise included, is kept: twice projected, it is
# an orthogonal direction.
_DEPENDENT = 2.0 ** -20
# Matrices share one padded stack while its padding stays within this bound (elements).
_PAD_FACTOR, _PAD_SLACK = 4, 1 << 20
_KEPT_STACKS = 64  # batches of warm starts kept as stacks (a model's buckets, a few times over)


def orthonormalize(mats: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """For each ``n × r`` matrix (``r ≤ n``) of ``mats``, one with orthonormal columns that span
    its columns; fp32, computed for many matrices at once.

    Classical Gram-Schmidt with the projections taken twice ("twice is enough": Giraud et al.,
    Numer. Math. 2005), which keeps the columns orthonormal to fp32 rounding, on a zero-padded
    stack of the matrices: a constant number of batched operations for all of them, where a
    Householder QR costs a few dozen kernel launches per matrix on a GPU. Each column is first
    scaled by its largest magnitude (its direction, and so the result, stays as it is), so no
    norm overflows or underflows, however small a column is beside the others. A column that
    lies in the span of the ones before it (a rank-deficient or zero matrix) is replaced by a fixed
    direction orthogonalised the same way, so the result is orthonormal for every finite input:
    ``Q Qᵀ`` is a projection onto a space holding the matrix's columns. Deterministic for a
    given input (every rank orthonormalises the same all-reduced factors); a matrix with NaN or
    ±inf comes back all NaN, so a non-finite step stays visible.
    """
    return _unstacked(orthonormal_stacks(mats), [m.shape[0] for m in mats])


def _unstacked(stacks: Sequence[Tuple[List[int], torch.Tensor]], rows: Sequence[int]) -> List[torch.Tensor]:
    """The matrices of ``(indices, stack)`` pairs back in their order, each a view of its
    ``rows[i]`` rows of its stack."""
    out: List[Optional[torch.Tensor]] = [None] * len(rows)
    for batch, stack in stacks:
        for i, q in zip(batch, stack):
            out[i] = q[: rows[i]]
    return out  # type: ignore[return-value]


def orthonormal_stacks(mats: Sequence[torch.Tensor]) -> List[Tuple[List[int], torch.Tensor]]:
    """:func:`orthonormalize` as it computes it: ``(indices, stack)`` pairs, the stack holding
    the results for ``mats[indices]``, zero-padded to the tallest (the first)."""
    stacks = []
    for batch in _stack_batches([m.shape for m in mats], [m.device for m in mats]):
        rows, r = tuple(mats[i].shape[0] for i in batch), mats[batch[0]].shape[1]
        stack = padded_stack([mats[i] for i in batch])
        _gram_schmidt(stack, _fillers(rows, r, stack.device))
        stacks.append((batch, stack))
    return stacks


def orthonormal_packed(flat: torch.Tensor, shapes: Sequence[Tuple[int, int]]) -> List[Tuple[List[int], torch.Tensor]]:
    """:func:`orthonormal_stacks` of the ``n × r`` matrices whose transposes (``r × n``, row
    by row) lie back to back in ``flat``, as PowerSGD packs its factors for the all-reduce:
    each stack is filled from ``flat`` by one indexed copy (no copy a matrix). The stacks are
    those :func:`orthonormal_stacks` makes of the same matrices, so are the results: each an
    ``n × r`` view of rows of ``r`` values, a layout that does not depend on the other matrices
    of its stack (a product's rounding may depend on its operands' layout)."""
    starts, at = [], 0
    for n, r in shapes:
        starts.append(at)
        at += n * r
    stacks = []
    for batch in _stack_batches(shapes, [flat.device] * len(shapes)):
        rows, r = tuple(shapes[i][0] for i in batch), shapes[batch[0]][1]
        src, dst = _packed_index(tuple(starts[i] for i in batch), rows, r, flat.numel(), flat.device)
        values = flat if src is None else flat.index_select(0, src)
        stack = torch.zeros(len(batch), rows[0], r, dtype=torch.float32, device=flat.device)
        stack.view(-1).index_copy_(0, dst, values.float())
        _gram_schmidt(stack, _fillers(rows, r, flat.device))
        stacks.append((batch, stack))
    return stacks


def _stack_batches(shapes: Sequence[Sequence[int]], devices: Sequence[torch.device]) -> List[List[int]]:
    """The matrices that share a padded stack: by rank and device, tallest first, cut where
    padding would grow past :data:`_PAD_FACTOR` (:func:`_padded_batches`)."""
    by_kind: Dict[Tuple[int, torch.device], List[int]] = {}
    for i, (shape, device) in enumerate(zip(shapes, devices)):
        by_kind.setdefault((shape[1], device), []).append(i)
    rows = [shape[0] for shape in shapes]
    out = []
    for idx in by_kind.values():
        out.extend(_padded_batches(sorted(idx, key=lambda i: -rows[i]), rows))
    return out


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """One matrix's :func:`orthonormalize`."""
    return orthonormalize([p])[0]


def _padded_batches(order: List[int], rows: Sequence[int]) -> List[List[int]]:
    """``order`` (tallest first) cut into runs whose padded stack stays near their own size."""
    batches: List[List[int]] = []
    real = 0
    for i in order:
        n = rows[i]
        if batches and (len(batches[-1]) + 1) * rows[batches[-1][0]] <= _PAD_FACTOR * (real + n) + _PAD_SLACK:
            batches[-1].append(i)
            real += n
        else:
            batches.append([i])
            real = n
    return batches


def padded_stack(mats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``n_i × r`` matrices, tallest first, as one zero-padded fp32 ``k × n_0 × r`` stack (a
    few operations for them all)."""
    rows, r, device = tuple(m.shape[0] for m in mats), mats[0].shape[1], mats[0].device
    if len(mats) == 1:
        return mats[0].to(torch.float32, copy=True, memory_format=torch.contiguous_format).reshape(1, rows[0], r)
    stack = torch.zeros(len(mats), rows[0], r, dtype=torch.float32, device=device)
    flat = torch.cat([m.reshape(-1) for m in mats]).to(torch.float32)
    stack.view(-1).index_copy_(0, _slots(rows, r, device), flat)
    return stack


@layout_cache  # (the layouts of a model's factors repeat every step)
def _slots(rows: Tuple[int, ...], r: int, device: torch.device) -> torch.Tensor:
    """Where each value of the concatenated matrices goes in their padded stack."""
    width = rows[0] * r
    return torch.cat([i * width + torch.arange(n * r) for i, n in enumerate(rows)]).to(device)


@layout_cache
def _packed_index(starts: Tuple[int, ...], rows: Tuple[int, ...], r: int, total: int, device: torch.device
                  ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """For the transposed ``n_i × r`` matrices at ``starts`` of a packed buffer of ``total``
    values, in stack order: the values to take from it (None: all of it, as it lies) and where
    each goes in their ``k × n_0 × r`` stack."""
    width = rows[0] * r
    dst = torch.cat([  # value (c, j) of a transpose is value (j, c) of the matrix
        (i * width + torch.arange(r)[:, None] + torch.arange(n)[None, :] * r).reshape(-1)
        for i, n in enumerate(rows)
    ])
    src = torch.cat([a + torch.arange(n * r) for a, n in zip(starts, rows)])
    whole = src.numel() == total and bool((src == torch.arange(total)).all())
    return (None if whole else src.to(device)), dst.to(device)


@layout_cache
def _fillers(rows: Tuple[int, ...], r: int, device: torch.device) -> torch.Tensor:
    """The fixed directions that stand in for dependent columns: value ``(i, j)`` of every
    matrix a counter hash of ``i · r + j`` (the same bits on every device and host, and the same
    for a matrix whatever the height of the others in its stack), zero in each matrix's padding
    (so orthonormalising one keeps it inside the matrix); the first column normalised."""
    base = (counter_uniform(rows[0] * r, 0x5EED) - 0.5).view(rows[0], r)
    fill = torch.zeros(len(rows), rows[0], r)
    for i, n in enumerate(rows):
        fill[i, :n] = base[:n]
    first = fill[:, :, :1]  # used as it is (nothing is projected out of a first column)
    first.div_(torch.linalg.vector_norm(first, dim=1, keepdim=True))
    return fill.to(device)


def _gram_schmidt(a: torch.Tensor, fill: torch.Tensor) -> None:
    """Orthonormalise the columns of every matrix of the stack ``a`` (``k × n × r``) in place.

    Each column after the first is projected side by side with its filler (one ``k × n × 2``
    pair: one product and one update a projection for both), so a stack costs about a dozen
    operations a column, whatever its number of matrices: on an accelerator each costs host
    time, which is what a bucket of small factors is made of."""
    top = a.abs().amax(dim=1, keepdim=True)  # each column's largest magnitude; NaN where it holds one
    # ``+ matrix's top * 0``: NaN for a NaN or ±inf anywhere in the matrix, so it comes back all NaN
    a.div_(torch.where(top > 0, top, 1.0).add_(top.amax(dim=2, keepdim=True) * 0))
    v = a[:, :, :1]
    norm = torch.linalg.vector_norm(v, dim=1, keepdim=True)
    # the first column: nothing to project out, so it is dependent only where it is zero; its
    # filler is stored normalised (_fillers)
    a[:, :, :1] = torch.where(norm <= norm * _DEPENDENT, fill[:, :, :1], v / norm)
    for j in range(1, a.shape[2]):
        pair = torch.cat([a[:, :, j : j + 1], fill[:, :, j : j + 1]], dim=2)  # the column and its filler
        before = torch.linalg.vector_norm(pair[:, :, :1], dim=1, keepdim=True)
        done = a[:, :, :j]
        if a.device.type == "cpu":  # a CPU's bmm copies a strided operand matrix by matrix: one copy here
            done = done.contiguous()
        for _ in range(2):
            pair = torch.baddbmm(pair, done, done.transpose(1, 2) @ pair, alpha=-1)
        after = torch.linalg.vector_norm(pair, dim=1, keepdim=True)  # the column's and the filler's
        dependent = after[:, :, :1] <= before * _DEPENDENT  # NaN compares False: a NaN column stays
        unit = pair / after
        a[:, :, j : j + 1] = torch.where(dependent, unit[:, :, 1:], unit[:, :, :1])


@register_codec
class PowerSGD(Codec):
    """PowerSGD rank-r compression (Vogels et al., PowerSGD, NeurIPS'19).

    A gradient of shape ``(n, ...)`` is viewed as an ``n × m`` matrix M and approximated by
    ``P Qᵀ`` with one power-iteration step in two all-reduce rounds: ``P = M Q`` is summed and
    orthonormalised, then ``Q = Mᵀ P`` is summed. Q is warm-started from the previous step (per
    tensor name), and the first Q comes from a generator shared by all ranks; Q is kept
    orthonormalised (the same column span, so the same approximation), which keeps ``P`` at the
    scale of ``M`` rather than of ``M²``. ``P`` is orthonormalised (:func:`orthonormalize`:
    Gram-Schmidt twice, every matrix of a bucket in one batch), so a rank-deficient ``M`` (rank
    below r, a constant or zero matrix) comes back exactly and the result is always a
    projection of ``M``: its error is never larger than ``M``. A column that lies in the span of
    the others is replaced by a fixed direction, so a zero step does not shrink the rank of the
    steps after it. Tensors with fewer than two dimensions, or where the factors would not be
    smaller than the tensor (``(n + m) r ≥ n m``, or ``4 (n + m) r`` bytes above the raw size of
    a 16-bit input), pass through uncompressed. Biased: use it with error feedback
    (``memory="residual"``, the default).

    The factors are fp32 sums of ``m`` (or ``n``) products: entries above about
    ``3.4e38 / max(n, m)`` can overflow them; the all-reduce reads its last round's sums and
    flags such a step like one with a NaN input (a NaN average on every rank, error feedback's
    residual kept). A 16-bit input is decoded with its finite range saturated (:func:`saturate`).

    Options: ``rank`` (default 2), ``warm_start`` (default True), ``seed``.
    Wire: ``(n + m) · rank · 4`` bytes over two rounds. Collective: ``allreduce``.

    Speed: each round is a matrix product that reads the whole gradient, with a collective and
    a thin orthonormalisation between them, so it is bound by the products' reads, not by a
    copy: on one 64 Mi-value matrix an H200 ran encode at 51% of a device copy and decode at
    15% (57% / 22% in a stream).

    A fused group (:attr:`~gradzip.codecs.base.Codec.parts_format`: the engine hands over the
    group's flat buffer with each member's name and shape, ``Meta.parts``) is one call: every
    matrix's ``Pᵀ`` is written by its product into one packed tensor, summed by one all-reduce,
    orthonormalised in one batch, and every ``Qᵀ`` into another, with the tensors too small to
    factorise (1-D ones, tiny matrices) sent as they are in that second round (fp32 values in
    the same tensor; a 16-bit gradient's in its own width beside it, also where error feedback
    compensates it in fp32); one non-finite flag covers the group. Each tensor keeps its own
    warm start, by name, so the values are those of each tensor alone up to the last bits,
    which a product takes from where its output lies in memory (the same on every rank).
    One call a group rather than one a matrix is what brings its host time near PyTorch's
    PowerSGD hook, which packs a bucket's factors the same way: ResNet-50 with its channels
    divided by 8 in one DDP bucket, one CPU rank (``python scripts/powersgd_ops.py
    --against-torch``, four runs alternating with one call a matrix): 1.02–1.29× what PyTorch's
    hook adds to a step, where one call a matrix added 1.59–1.84×. On an H200 (one rank over
    NCCL, ``gradzip bench overhead --device cuda``, six runs): 0.33–0.75× what PyTorch's hook
    adds to a ResNet-50 step and 0.37–0.49× on GPT-2 small, where one call a matrix added
    0.83–1.36× and 0.87–1.49×.
    """

    name = "powersgd"
    family = "low-rank"
    paper = "Vogels et al., PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization, NeurIPS'19"
    collectives = ("allreduce",)
    default_memory = "residual"
    summable = True
    raw_fallback = False  # passes small matrices through itself (``_matrix``)
    # P = M Q: a NaN or ±inf of M makes its row of P NaN or ±inf whatever Q is (NaN · 0 = NaN)
    payload_keeps_nonfinite = True
    # the average is P Qᵀ with the summed Q (or the summed matrix itself where it went raw): a
    # NaN Q makes every value NaN
    stats_tensor = 0
    payload_linear = True  # P = M Q, Q = Mᵀ P̂ and the values sent as they are: linear in M
    tensor_state = "q"
    parts_format = True  # a fused group: one call, its factors packed (see the class docstring)
    flat_parts_as_they_are = True  # (1-D tensors are never factorised)
    needs_shapes = True  # a flat share of a node's sum could not be factorised
    options = {
        "rank": Option(2, int_in(1), "a positive integer", "rank of the approximation"),
        "warm_start": Option(True, lambda v: isinstance(v, bool), "True or False", "reuse last step's Q"),
        "seed": SEED,
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        # per tensor: the next step's Q, orthonormal (saved by Codec.state_dict: tensor_state);
        # the values are views of stacks kept per batch of tensors (``_warm``)
        self._q: Dict[str, torch.Tensor] = {}
        self._warm: Dict[Tuple[str, ...], Tuple[torch.Tensor, List[torch.Tensor]]] = {}
        self._cold: Dict[Tuple[str, int, int, str], torch.Tensor] = {}  # the shared random Qs
        self._layouts: Dict[Tuple[Any, ...], _Layout] = {}

    def _matrix(self, shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[Tuple[int, int, int]]:
        """(n, m, r) when compressing ``shape`` pays off, else None."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape[1:])
        r = min(self.rank, n, m)
        if (n + m) * r >= n * m or (n + m) * r * 4 > n * m * element_size(dtype):
            return None
        return n, m, r

    def _layout(self, meta: Meta) -> "_Layout":
        """Where each tensor of the input goes in the payloads (made once per layout)."""
        parts = meta.parts if meta.parts is not None else ((meta.name, meta.shape),)
        key = (parts, meta.as_is, self.rank)  # (whether a matrix pays off: against the width it would go in)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > 256:
                self._layouts.clear()
            lay = self._layouts[key] = _Layout(parts, meta.as_is, self._matrix)
        return lay

    def _cold_q(self, name: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        """The first Q of tensor ``name``, the same on every rank: from a generator shared by
        all ranks, orthonormalised (made once; it is also the fallback after a non-finite step)."""
        key = (name, m, r, str(device))
        q = self._cold.get(key)
        if q is None:
            gen = shared_generator(self.seed, 0, name, device)
            q = self._cold[key] = orthogonalize(torch.randn(m, r, generator=gen, device=device))
        return q

    def _initial_q(self, name: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        """This step's Q of tensor ``name``, orthonormal: last step's (warm start) or the shared random one."""
        q = self._q.get(name)
        if self.warm_start and q is not None and q.shape == (m, r):
            return q.to(device)
        return self._cold_q(name, m, r, device)

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        """Round 1: every matrix's ``P = M Q``, stored transposed (``r × n``) and packed into one
        tensor; a short, wide product is what a CPU's BLAS does best, and a GPU's takes either.
        Tensors sent as they are go with the last round (so this rank's own last payload holds
        them, as error feedback needs); with no matrix to factorise the input goes as it is."""
        lay = self._layout(meta)
        if not lay.mats:
            meta.extra["round"] = 0
            return [as_wire(x, meta.wire)]
        xf = x.float().contiguous()  # (no copy of a contiguous fp32 input) BLAS rounds by layout: one on every rank
        pt = torch.empty(lay.p_numel, dtype=torch.float32, device=x.device)
        for mat in lay.mats:
            torch.mm(self._initial_q(mat.name, mat.m, mat.r, x.device).T, mat.of(xf).T, out=mat.p(pt))
        raw = None
        if lay.raws:
            # the tensors sent as they are go in the last round, whose 16-bit sums are clamped to
            # the type's range (an overflow of finite shares is no NaN): a NaN or ±inf among them
            # makes the first factor's first value NaN, so the step is flagged from this round,
            # on every rank, as a non-finite factorised tensor's is (no host read)
            raw = lay.gather_raw(x)
            pt[:1] = torch.where(nonfinite_flag(raw), float("nan"), pt[:1])
        meta.extra.update(round=1, x=x, xf=xf, layout=lay, raw=raw)
        return [pt]

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the first payload: ``P = M Q`` carries every NaN or ±inf of a factorised tensor
        (``NaN · 0`` is NaN) and, as a NaN first value, of the tensors sent as they are beside
        the factors (see :meth:`_encode`); a payload sent as it is is the input."""
        return None if not payload.tensors else nonfinite_flag(payload.tensors[0])

    def next_round(self, payload: Payload, reduced: List[torch.Tensor]) -> Optional[Payload]:
        return self.next_round_many([payload], [reduced])[0]

    def next_round_many(
        self, payloads: Sequence[Payload], reduced: Sequence[List[torch.Tensor]],
    ) -> List[Optional[Payload]]:
        """Round 1 (``P`` summed): ``P̂``, every matrix's ``P`` orthonormalised in one batch, and
        ``Q = Mᵀ P̂`` (transposed, packed) to sum next, with the tensors sent as they are.
        Round 2 (``Q`` summed): the warm starts of the next step."""
        out: List[Optional[Payload]] = [None] * len(payloads)
        first = [i for i, p in enumerate(payloads) if p.ctx.extra.get("round") == 1]  # (an empty input has none)
        hats = self._p_hats([payloads[i].ctx.extra["layout"] for i in first], [reduced[i][0] for i in first])
        for i, p_hat in zip(first, hats):
            meta = payloads[i].ctx
            tensors = self._second_factors(meta, p_hat)
            meta.extra.update(round=2, P=p_hat)
            del meta.extra["xf"], meta.extra["x"], meta.extra["raw"]  # the input is read no more
            out[i] = Payload(tensors, meta)
        second = [i for i, p in enumerate(payloads) if p.ctx.extra.get("round") == 2 and out[i] is None]
        if second and self.warm_start:
            self._keep_warm([payloads[i].ctx.extra["layout"] for i in second], [reduced[i][0] for i in second])
        return out

    def _p_hats(self, layouts: Sequence["_Layout"], sums: Sequence[torch.Tensor]) -> List[List[torch.Tensor]]:
        """Each layout's ``P̂``s (``n × r``) from its summed, packed ``Pᵀ``: all in one batch."""
        if not layouts:
            return []
        flat = sums[0] if len(sums) == 1 else torch.cat([s[: lay.p_numel] for s, lay in zip(sums, layouts)])
        shapes = [(mat.n, mat.r) for lay in layouts for mat in lay.mats]
        hats = _unstacked(orthonormal_packed(flat, shapes), [n for n, _ in shapes])
        out, at = [], 0
        for lay in layouts:
            out.append(hats[at : at + len(lay.mats)])
            at += len(lay.mats)
        return out

    def _keep_warm(self, layouts: Sequence["_Layout"], sums: Sequence[torch.Tensor]) -> None:
        """Next step's Qs: this step's summed ones, orthonormalised. A non-finite step (NaN/Inf on
        any rank: the sum is then non-finite everywhere, and its orthonormalised Q all NaN)
        keeps the Q before it, or every later step would be NaN too."""
        # (each sum's Qᵀ alone: an fp32 input's raw values follow them in the same tensor; one
        # sum's as a view, so its stacks fill from it as it lies, with no indexed read)
        flat = (sums[0][: layouts[0].q_numel] if len(sums) == 1
                else torch.cat([s[: lay.q_numel] for s, lay in zip(sums, layouts)]))
        mats = [mat for lay in layouts for mat in lay.mats]
        for batch, stack in orthonormal_packed(flat, [(mat.m, mat.r) for mat in mats]):
            names = tuple(mats[i].name for i in batch)
            kept = self._warm.get(names)
            if kept is not None and kept[0].shape == stack.shape and all(
                self._q.get(mats[i].name) is q and q.shape == (mats[i].m, mats[i].r) for q, i in zip(kept[1], batch)
            ):
                old = kept[0]  # the stack whose views are these tensors' Qs now, in their shapes
            else:  # each tensor's current Q (or its first one) where the stack is not that
                old = padded_stack([self._initial_q(mats[i].name, mats[i].m, mats[i].r, flat.device) for i in batch])
            corner = stack[:, :1, :1]
            stack = torch.where(corner == corner, stack, old)  # NaN != NaN
            views = [q[: mats[i].m] for i, q in zip(batch, stack)]
            if len(self._warm) >= _KEPT_STACKS and names not in self._warm:
                self._warm.clear()
            self._warm[names] = (stack, views)
            for name, q in zip(names, views):
                self._q[name] = q

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "q_orthonormal": True}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._warm.clear()
        if not state.get("q_orthonormal", False):  # saved when Qs were stored as summed
            names = list(self._q)
            self._q = dict(zip(names, orthonormalize([self._q[n] for n in names])))

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        if meta.extra["round"] == 0:
            return tensors[0]
        out = torch.empty(meta.numel, dtype=torch.float32, device=tensors[0].device)
        return self._write(tensors, meta, out)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        # the products written straight into ``out``: no matrix-sized temporary and no copy
        if (meta.extra["round"] != 0 and not accumulate and out.numel() == meta.numel and out.is_contiguous()
                and out.dtype == torch.float32):
            self._write(tensors, meta, out.view(-1))
            return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def _second_factors(self, meta: Meta, hats: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The second round's payload: each matrix's ``Qᵀ = P̂ᵀ M`` packed, and the tensors sent as
        they are; for fp32 values in one tensor (one all-reduce), else in their own dtype (or
        the wire's, :attr:`~gradzip.codecs.base.Meta.wire`) beside it."""
        lay, xf, raw = meta.extra["layout"], meta.extra["xf"], meta.extra["raw"]
        one = meta.as_is == torch.float32
        qt = torch.empty(lay.q_numel + (lay.raw_numel if one else 0), dtype=torch.float32, device=xf.device)
        for mat, h in zip(lay.mats, hats):
            torch.mm(h.T, mat.of(xf), out=mat.q(qt))
        if raw is None:
            return [qt]
        if one:
            qt[lay.q_numel :].copy_(raw)
            return [qt]
        return [qt, as_wire(raw, meta.wire)]

    def _write(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor) -> torch.Tensor:
        """Decode a payload of round 1 or 2 into the flat fp32 ``out``:
        ``P̂ Qᵀ`` a matrix, one product each, and the tensors sent as they are."""
        lay = meta.extra["layout"]
        if meta.extra["round"] == 1:  # a local round trip without a collective: finish the power step here
            (hats,) = self._p_hats([lay], tensors[:1])
            tensors = self._second_factors(meta, hats)
        else:
            hats = meta.extra["P"]
        qt = tensors[0]
        for mat, h in zip(lay.mats, hats):
            torch.mm(h, mat.q(qt), out=mat.of(out))
        if lay.raws:
            lay.write_raw(qt[lay.q_numel :] if len(tensors) == 1 else tensors[1], out)
        return out

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32, shape: Optional[Tuple[int, ...]] = None,
                   wire: Optional[torch.dtype] = None) -> int:
        """Bytes over both rounds; needs ``shape`` (without it the tensor counts as 1-D). Its
        factors go in fp32; the values it sends as they are go in ``wire`` where it is the
        narrower (as :meth:`~gradzip.codecs.base.Codec.wire_bytes` takes it), else the input's dtype."""
        if numel == 0:
            return 0
        dtype = _narrower(wire, dtype) or dtype
        dims = self._matrix(tuple(shape) if shape is not None else (numel,), dtype)
        if dims is None:
            return numel * element_size(dtype)
        n, m, r = dims
        return (n + m) * r * 4



class _Matrix:
    """One factorised tensor of a PowerSGD input: ``n × m`` at ``at`` in the input, rank ``r``,
    its ``Pᵀ`` at ``p_at`` and ``Qᵀ`` at ``q_at`` of the packed factors."""

    __slots__ = ("name", "at", "n", "m", "r", "p_at", "q_at")

    def __init__(self, name: str, at: int, n: int, m: int, r: int, p_at: int, q_at: int) -> None:
        self.name, self.at, self.n, self.m, self.r, self.p_at, self.q_at = name, at, n, m, r, p_at, q_at

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The matrix in a flat buffer as long as the input."""
        return flat[self.at : self.at + self.n * self.m].view(self.n, self.m)

    def p(self, pt: torch.Tensor) -> torch.Tensor:
        """Its ``Pᵀ`` (``r × n``) in the packed first factors."""
        return pt[self.p_at : self.p_at + self.r * self.n].view(self.r, self.n)

    def q(self, qt: torch.Tensor) -> torch.Tensor:
        """Its ``Qᵀ`` (``r × m``) in the packed second factors."""
        return qt[self.q_at : self.q_at + self.r * self.m].view(self.r, self.m)


class _Layout:
    """Where each tensor of a PowerSGD input goes: the matrices it factorises (``mats``) and
    the spans it sends as they are (``raws``: ``(start, length)``, neighbours merged), made
    once per input layout (``parts`` and dtype)."""

    def __init__(self, parts: Sequence[Tuple[str, torch.Size]], dtype: torch.dtype,
                 matrix: Callable[[Tuple[int, ...], torch.dtype], Optional[Tuple[int, int, int]]]) -> None:
        self.mats: List[_Matrix] = []
        self.raws: List[Tuple[int, int]] = []
        at = p_at = q_at = 0
        for name, shape in parts:
            numel = shape.numel()
            dims = matrix(tuple(shape), dtype)
            if dims is None:
                if numel and self.raws and sum(self.raws[-1]) == at:
                    self.raws[-1] = (self.raws[-1][0], self.raws[-1][1] + numel)
                elif numel:
                    self.raws.append((at, numel))
            else:
                n, m, r = dims
                self.mats.append(_Matrix(name, at, n, m, r, p_at, q_at))
                p_at += r * n
                q_at += r * m
            at += numel
        self.p_numel, self.q_numel = p_at, q_at
        self.raw_numel = sum(n for _, n in self.raws)

    def gather_raw(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The spans sent as they are, gathered from the flat input ``x`` (into ``out``, of
        :attr:`raw_numel` values, or a new tensor of ``x``'s dtype): one operation."""
        return torch.cat([x[a : a + n] for a, n in self.raws], out=out)

    def write_raw(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """The spans sent as they are, from their gathered (summed) ``raw``, into the flat ``out``:
        one multi-tensor copy (a DDP bucket averaged where it lies has a bias between matrices)."""
        dst = [out[a : a + n] for a, n in self.raws]
        # (one dtype both sides: CUDA's multi-tensor copy takes its kernel from the destination's)
        src = list(raw[: self.raw_numel].to(out.dtype).split([n for _, n in self.raws]))
        if len(dst) == 1:
            dst[0].copy_(src[0])
        else:
            torch._foreach_copy_(dst, src)
