"""Low-rank codec: PowerSGD."""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..kernels import shared_generator
from ..kernels.rng import counter_uniform
from .base import SEED, Codec, Meta, Option, Payload, element_size, int_in
from .registry import register_codec


def times(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``m @ v`` for a thin ``v`` (``k × r``, r small), contiguous. On the CPU computed as
    ``(vᵀ mᵀ)ᵀ``: one row of r outputs per stride of ``m`` is what BLAS does worst; a short,
    wide product is what it does best (on one core 1.5–10× faster for gradient-sized matrices).
    A GPU's BLAS takes either layout as fast, so there it is one product, without the copy
    that makes the transposed result contiguous. ``m`` may be a transposed view (``Mᵀ P``)."""
    if m.device.type != "cpu":
        return m @ v
    return (v.T @ m.T).T.contiguous()


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
    out: List[Optional[torch.Tensor]] = [None] * len(mats)
    for batch, stack in orthonormal_stacks(mats):
        for i, q in zip(batch, stack):
            out[i] = q[: mats[i].shape[0]]
    return out  # type: ignore[return-value]


def orthonormal_stacks(mats: Sequence[torch.Tensor]) -> List[Tuple[List[int], torch.Tensor]]:
    """:func:`orthonormalize` as it computes it: ``(indices, stack)`` pairs, the stack holding
    the results for ``mats[indices]``, zero-padded to the tallest (the first)."""
    by_kind: Dict[Tuple[int, torch.device], List[int]] = {}
    for i, m in enumerate(mats):
        by_kind.setdefault((m.shape[1], m.device), []).append(i)
    stacks = []
    for (r, device), idx in by_kind.items():
        for batch in _padded_batches(sorted(idx, key=lambda i: -mats[i].shape[0]), mats):
            rows = tuple(mats[i].shape[0] for i in batch)
            stack = padded_stack([mats[i] for i in batch])
            _gram_schmidt(stack, _fillers(rows, r, device))
            stacks.append((batch, stack))
    return stacks


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """One matrix's :func:`orthonormalize`."""
    return orthonormalize([p])[0]


def _padded_batches(order: List[int], mats: Sequence[torch.Tensor]) -> List[List[int]]:
    """``order`` (tallest first) cut into runs whose padded stack stays near their own size."""
    batches: List[List[int]] = []
    real = 0
    for i in order:
        n = mats[i].shape[0]
        if batches and (len(batches[-1]) + 1) * mats[batches[-1][0]].shape[0] <= _PAD_FACTOR * (real + n) + _PAD_SLACK:
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
        return mats[0].to(torch.float32, copy=True).reshape(1, rows[0], r)
    stack = torch.zeros(len(mats), rows[0], r, dtype=torch.float32, device=device)
    flat = torch.cat([m.reshape(-1) for m in mats]).to(torch.float32)
    stack.view(-1).index_copy_(0, _slots(rows, r, device), flat)
    return stack


_CACHE: Dict[Tuple[Any, ...], torch.Tensor] = {}


def _cached(key: Tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Index and filler tensors, made once per layout (the layouts of a model's factors repeat
    every step)."""
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) > 256:
            _CACHE.clear()
        got = _CACHE[key] = make()
    return got


def _slots(rows: Tuple[int, ...], r: int, device: torch.device) -> torch.Tensor:
    """Where each value of the concatenated matrices goes in their padded stack."""
    def make() -> torch.Tensor:
        width = rows[0] * r
        return torch.cat([i * width + torch.arange(n * r) for i, n in enumerate(rows)]).to(device)
    return _cached(("slots", rows, r, device), make)


def _fillers(rows: Tuple[int, ...], r: int, device: torch.device) -> torch.Tensor:
    """The fixed directions that stand in for dependent columns: value ``(i, j)`` of every
    matrix a counter hash of ``i · r + j`` (the same bits on every device and host, and the same
    for a matrix whatever the height of the others in its stack), zero in each matrix's padding
    (so orthonormalising one keeps it inside the matrix); the first column normalised."""
    def make() -> torch.Tensor:
        base = (counter_uniform(rows[0] * r, 0x5EED) - 0.5).view(rows[0], r)
        fill = torch.zeros(len(rows), rows[0], r)
        for i, n in enumerate(rows):
            fill[i, :n] = base[:n]
        first = fill[:, :, :1]  # used as it is (nothing is projected out of a first column)
        first.div_(torch.linalg.vector_norm(first, dim=1, keepdim=True))
        return fill.to(device)
    return _cached(("fill", rows, r, device), make)


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
    15% (57% / 22% in a stream). The tensors of a bucket share each round's all-reduce, its
    non-finite flag (one pass over the packed factors) and its orthonormalisation
    (``AllReduce.exchange_many``, :meth:`next_round_many`): in a DDP step on an H200 it added
    32.2 ms to ResNet-50's and 45.8 ms to GPT-2's, where PyTorch's PowerSGD hook added 34.3 and
    43.6 ms (``gradzip bench overhead --device cuda``).
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
    tensor_state = "q"
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

    def _cold_q(self, name: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        """The first Q of tensor ``name``, the same on every rank: from a generator shared by
        all ranks, orthonormalised (made once; it is also the fallback after a non-finite step)."""
        key = (name, m, r, str(device))
        q = self._cold.get(key)
        if q is None:
            gen = shared_generator(self.seed, 0, name, device)
            q = self._cold[key] = orthogonalize(torch.randn(m, r, generator=gen, device=device))
        return q

    def _initial_q(self, meta: Meta, m: int, r: int) -> torch.Tensor:
        """This step's Q, orthonormal: last step's (warm start) or the shared random one."""
        q = self._q.get(meta.name)
        if self.warm_start and q is not None and q.shape == (m, r):
            return q.to(meta.device)
        return self._cold_q(meta.name, m, r, meta.device)

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        dims = self._matrix(tuple(meta.shape), meta.dtype)
        if dims is None:
            meta.extra["round"] = 0
            return [x]
        n, m, r = dims
        mat = x.float().view(n, m).contiguous()  # BLAS rounds by layout: one layout on every rank
        meta.extra.update(round=1, M=mat)
        return [times(mat, self._initial_q(meta, m, r))]

    def next_round(self, payload: Payload, reduced: List[torch.Tensor]) -> Optional[Payload]:
        return self.next_round_many([payload], [reduced])[0]

    def next_round_many(
        self, payloads: Sequence[Payload], reduced: Sequence[List[torch.Tensor]],
    ) -> List[Optional[Payload]]:
        """Round 1 (``P`` summed): ``P̂``, every matrix's ``P`` orthonormalised in one batch, and
        ``Q = Mᵀ P̂`` to sum next. Round 2 (``Q`` summed): the warm starts of the next step."""
        out: List[Optional[Payload]] = [None] * len(payloads)
        first = [i for i, p in enumerate(payloads) if p.ctx.extra["round"] == 1]
        for i, p_hat in zip(first, orthonormalize([reduced[i][0] for i in first])):
            meta = payloads[i].ctx
            meta.extra.update(round=2, P=p_hat)
            out[i] = Payload([times(meta.extra["M"].T, p_hat)], meta)
        second = [i for i, p in enumerate(payloads) if p.ctx.extra["round"] == 2 and out[i] is None]
        if second and self.warm_start:
            self._keep_warm([payloads[i].ctx for i in second], [reduced[i][0] for i in second])
        return out

    def _keep_warm(self, metas: Sequence[Meta], qs: Sequence[torch.Tensor]) -> None:
        """Next step's Qs: this step's summed ones, orthonormalised. A non-finite step (NaN/Inf on
        any rank: the sum is then non-finite everywhere, and its orthonormalised Q all NaN)
        keeps the Q before it, or every later step would be NaN too."""
        for batch, stack in orthonormal_stacks(qs):
            names = tuple(metas[i].name for i in batch)
            kept = self._warm.get(names)
            if kept is not None and kept[0].shape == stack.shape and all(
                self._q.get(name) is q and q.shape == qs[i].shape for name, q, i in zip(names, kept[1], batch)
            ):
                old = kept[0]  # the stack whose views are these tensors' Qs now, in their shapes
            else:  # each tensor's current Q (or its first one) where the stack is not that
                old = padded_stack([self._initial_q(metas[i], *qs[i].shape) for i in batch])
            corner = stack[:, :1, :1]
            stack = torch.where(corner == corner, stack, old)  # NaN != NaN
            views = [q[: qs[i].shape[0]] for i, q in zip(batch, stack)]
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
        rnd = meta.extra["round"]
        if rnd == 0:
            return tensors[0]
        if rnd == 1:  # a local round trip without a collective: finish the power step here
            p_hat = orthogonalize(tensors[0])
            return (p_hat @ times(meta.extra["M"].T, p_hat).T).reshape(-1)
        return (meta.extra["P"] @ tensors[0].T).reshape(-1)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        # the product written straight into ``out``: no matrix-sized temporary and no copy
        if (meta.extra["round"] == 2 and not accumulate and out.numel() == meta.numel and out.is_contiguous()
                and out.dtype == torch.float32):
            n, m = meta.extra["M"].shape
            torch.mm(meta.extra["P"], tensors[0].T, out=out.view(n, m))
            return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def wire_bytes(self, numel: int, dtype: torch.dtype = torch.float32, shape: Optional[Tuple[int, ...]] = None) -> int:
        """Bytes over both rounds; needs ``shape`` (without it the tensor counts as 1-D)."""
        if numel == 0:
            return 0
        dims = self._matrix(tuple(shape) if shape is not None else (numel,), dtype)
        if dims is None:
            return numel * element_size(dtype)
        n, m, r = dims
        return (n + m) * r * 4

