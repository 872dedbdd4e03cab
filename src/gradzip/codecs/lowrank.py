"""Low-rank codec: PowerSGD."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..kernels import shared_generator
from .base import SEED, Codec, Meta, Option, Payload, all_finite, element_size, int_in, nonfinite_poison
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


def orthogonalize(p: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """An ``n × r`` matrix whose orthonormal columns span the columns of ``p`` (``r ≤ n``).

    The Q factor of a reduced Householder QR: orthonormal even when ``p`` is rank-deficient or
    zero (the missing directions are filled with other unit vectors, so ``Q Qᵀ`` stays a
    projection onto a space holding ``p``'s columns), deterministic for a given input (every
    rank orthonormalises the same all-reduced ``p``), and finite for finite input. Non-finite
    input gives an all-NaN result, so a NaN/Inf step stays visible; ``finite=True`` says that
    ``p`` is known to be finite (a warm start is kept only when it is), and skips that check.
    """
    q = torch.linalg.qr(p, mode="reduced").Q
    return q if finite else q.add_(nonfinite_poison(p))


@register_codec
class PowerSGD(Codec):
    """PowerSGD rank-r compression (Vogels et al., PowerSGD, NeurIPS'19).

    A gradient of shape ``(n, ...)`` is viewed as an ``n × m`` matrix M and approximated by
    ``P Qᵀ`` with one power-iteration step in two all-reduce rounds: ``P = M Q`` is summed and
    orthonormalised, then ``Q = Mᵀ P`` is summed. Q is warm-started from the previous step (per
    tensor name), and the first Q comes from a generator shared by all ranks; Q is
    orthonormalised before use (the same column span, so the same approximation), which keeps
    ``P`` at the scale of ``M`` rather than of ``M²``. ``P`` is orthonormalised by a QR
    factorisation, so a rank-deficient ``M`` (rank below r, a constant or zero matrix) comes
    back exactly and the result is always a projection of ``M``: its error is never larger
    than ``M``. Tensors with fewer than two dimensions, or where the factors would not be
    smaller than the tensor (``(n + m) r ≥ n m``, or ``4 (n + m) r`` bytes above the raw size of
    a 16-bit input), pass through uncompressed. Biased: use it with error feedback
    (``memory="residual"``, the default).

    The factors are fp32 sums of ``m`` (or ``n``) products: entries above about
    ``3.4e38 / max(n, m)`` can overflow them, and the step is then non-finite like one with a
    NaN input. A 16-bit input is decoded with its finite range saturated (:func:`saturate`).

    Options: ``rank`` (default 2), ``warm_start`` (default True), ``seed``.
    Wire: ``(n + m) · rank · 4`` bytes over two rounds. Collective: ``allreduce``.

    Speed: each round is a matrix product that reads the whole gradient and a QR factorisation
    of a thin matrix, with a collective between them, so it is bound by the products' reads, not
    by a copy: an H100 ran an earlier version's encode at 26–29% of a device copy and decode at
    18–19%, an H200 this one's at 27% and 16%. The tensors of a bucket share each round's
    all-reduce (see ``AllReduce.exchange_many``).
    """

    name = "powersgd"
    family = "low-rank"
    paper = "Vogels et al., PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization, NeurIPS'19"
    collectives = ("allreduce",)
    default_memory = "residual"
    summable = True
    raw_fallback = False  # passes small matrices through itself (``_matrix``)
    tensor_state = "q"
    options = {
        "rank": Option(2, int_in(1), "a positive integer", "rank of the approximation"),
        "warm_start": Option(True, lambda v: isinstance(v, bool), "True or False", "reuse last step's Q"),
        "seed": SEED,
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._q: Dict[str, torch.Tensor] = {}  # saved by Codec.state_dict (tensor_state)

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

    def _random_q(self, meta: Meta, m: int, r: int) -> torch.Tensor:
        gen = shared_generator(self.seed, 0, meta.name, meta.device)
        return torch.randn(m, r, generator=gen, device=meta.device)

    def _initial_q(self, meta: Meta, m: int, r: int) -> torch.Tensor:
        """This step's Q, orthonormal: last step's (warm start) or the shared random one."""
        q = self._q.get(meta.name)
        if not (self.warm_start and q is not None and q.shape == (m, r)):
            return orthogonalize(self._random_q(meta, m, r), finite=True)
        return orthogonalize(q.to(meta.device), finite=True)  # stored only when finite (next_round)

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
        meta = payload.ctx
        if meta.extra["round"] == 1:
            p_hat = orthogonalize(reduced[0])
            meta.extra.update(round=2, P=p_hat)
            return Payload([times(meta.extra["M"].T, p_hat)], meta)
        if meta.extra["round"] == 2 and self.warm_start:
            # a non-finite step (NaN/Inf on any rank: the sum is then non-finite everywhere) must
            # not become the next warm start, or every later step would be NaN too
            # (last step's Q, or the shared random one: orthonormalised when next used)
            q = reduced[0]
            old = self._q.get(meta.name)
            fallback = self._random_q(meta, *q.shape) if old is None or old.shape != q.shape else old.to(q.device)
            self._q[meta.name] = torch.where(all_finite(q), q, fallback)
        return None

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        rnd = meta.extra["round"]
        if rnd == 0:
            return tensors[0]
        if rnd == 1:  # a local round trip without a collective: finish the power step here
            p_hat = orthogonalize(tensors[0].clone())
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

