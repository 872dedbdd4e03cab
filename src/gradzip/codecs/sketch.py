"""SketchML: quantile-bucket quantization of values, delta-encoded keys for sparse gradients."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..kernels import fused, pack_bits, packed_bytes, reference, store_into, unpack_bits
from ..kernels.transfer import ints_on
from .base import (
    Codec, Meta, Option, Payload, as_wire, float_in, int_in, part_spans, raw_bytes, saturate, stats_nonfinite,
)
from .registry import register_codec
from .sparse import _group_topk, _k

# Quantile sketch resolution: values are keyed by the top KEY_BITS bits of their fp32 pattern
# (sign, 8 exponent bits, 9 mantissa bits), mapped to an order-preserving integer. A histogram
# over these keys is the sketch; its cells are 2**-9 relative wide at any magnitude.
KEY_BITS = 18
_CELLS = 1 << KEY_BITS
_ZERO_KEY = 1 << (KEY_BITS - 1)  # key of +0.0: the forced split between negative and positive values


def _num_buckets(count: int, buckets: int) -> int:
    """Buckets used for ``count`` values: never more than the values (tiny tensors, small tables)."""
    return max(2, min(buckets, count))


def _index_bits(nb: int) -> int:
    return max(1, (nb - 1).bit_length())


def _sortable_keys(xf: torch.Tensor) -> torch.Tensor:
    """int32 keys in ``[0, 2**KEY_BITS)``, non-decreasing in the fp32 value (−0.0 just below +0.0);
    every NaN the last key (``reference.sketch_keys``)."""
    return reference.sketch_keys(xf, KEY_BITS, _ZERO_KEY)


def _targets(n: int, nb: int, device: torch.device) -> torch.Tensor:
    """The ``nb - 2`` quantile targets of ``n`` values (fp64, whole numbers below ``n``): a split
    is the key of the value at each target's place in sorted order."""
    return torch.arange(1, nb - 1, dtype=torch.float64, device=device).mul_(n).div_(nb - 1).floor_()


def _quantize(values: torch.Tensor, nb: int, out: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """Quantile-bucket ``values`` (1-D) into ``nb`` buckets: [bucket index per value (packed
    uint8), means (fp32)], written into ``out`` (tensors of those forms) where given."""
    n = values.numel()
    xf = values.float().contiguous()
    dev = xf.device
    # the sketch: per-cell counts and sums (fp64 sums: a bucket's mean stays inside its range),
    # added in index order (on the CPU one C pass, or torch a piece at a time)
    hist, sums = fused.sketch_cells(xf, KEY_BITS, _ZERO_KEY)
    # nb - 2 quantile splits (a split is the first key of a bucket) plus the split at +0.0, so no
    # bucket mixes signs and the two signs share the buckets in proportion to their counts
    cdf = hist.cumsum_(0)  # (the counts in place: a bucket's count is a difference of two of these)
    splits = torch.searchsorted(cdf, _targets(n, nb, dev), right=True)  # first key holding more than target values
    splits = torch.cat([splits, torch.full((1,), _ZERO_KEY, dtype=splits.dtype, device=dev)])
    # lut[key] = number of splits <= key = bucket of the key; buckets are contiguous key ranges
    lut = torch.zeros(_CELLS, dtype=torch.int32, device=dev)
    lut.index_add_(0, splits, torch.ones(1, dtype=torch.int32, device=dev).expand(nb - 1))
    lut = lut.cumsum_(0)
    bucket_sums = torch.zeros(nb, dtype=torch.float64, device=dev).index_add_(0, lut, sums)
    # bucket b holds the keys from its split to the next (b splits at or below each): its count
    # is the values below the next split less those below its own (whole numbers: exact)
    edges = torch.cat([splits.new_zeros(1), splits.sort().values, splits.new_full((1,), _CELLS)])
    below = cdf.index_select(0, (edges - 1).clamp_min_(0)).masked_fill_(edges == 0, 0)
    bucket_counts = below.diff()
    means = bucket_sums.div_(bucket_counts.clamp_min_(1))  # empty buckets: 0 (never referenced)
    means = means.float() if out is None else out[1].copy_(means)
    codes, bits = lut.to(torch.uint8), _index_bits(nb)
    return [fused.sketch_codes(xf, KEY_BITS, _ZERO_KEY, codes, bits, None if out is None else out[0]), means]


def _dequantize(packed: torch.Tensor, means: torch.Tensor, count: int, out: Optional[torch.Tensor] = None,
                accumulate: bool = False) -> torch.Tensor:
    """The first ``count`` values: each code's bucket mean; into the flat ``out`` (added to it
    with ``accumulate``) if given (:func:`fused.codes_decode <gradzip.kernels.fused.codes_decode>`)."""
    return fused.codes_decode(packed, _index_bits(means.numel()), means, count, out, accumulate)


_GAP_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_BYTE = torch.arange(4)  # a gap's bytes, little-endian as a tensor's int32 view (both devices) has them


def _encode_gaps(gaps: torch.Tensor) -> torch.Tensor:
    """Gaps (int64, >= 0) in the narrowest of 1, 2 or 4 bytes that holds the largest, as raw bytes.

    Reads the largest gap on the host: the width, hence the payload size, depends on the data.
    """
    if gaps.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=gaps.device)
    return _narrow(gaps, _gap_width(int(gaps.max())))  # (the one host sync of sparse mode)


def _gap_width(largest: int) -> int:
    """The narrowest of 1, 2 or 4 bytes that holds gaps up to ``largest``."""
    return 1 if largest <= 0xFF else 2 if largest <= 0xFFFF else 4


def _narrow(gaps: torch.Tensor, width: int) -> torch.Tensor:
    """Gaps (int64) in ``width`` bytes each, as raw bytes."""
    if width == 1:
        return gaps.to(torch.uint8)
    if width == 2:  # int16 bit pattern of an unsigned 16-bit gap
        return torch.where(gaps > 0x7FFF, gaps - 0x10000, gaps).to(torch.int16).view(torch.uint8)
    return gaps.to(torch.int32).view(torch.uint8)


def _decode_gaps(raw: torch.Tensor, count: int) -> torch.Tensor:
    if count == 0:
        return raw.new_zeros(0, dtype=torch.int64)
    width = raw.numel() // count
    gaps = raw.view(_GAP_DTYPES[width]).to(torch.int64)
    return gaps & 0xFFFF if width == 2 else gaps


def _gap_bytes(gaps: torch.Tensor, widths: torch.Tensor, counts: torch.Tensor, total: int,
               one: Optional[int] = None) -> torch.Tensor:
    """Several tensors' gaps (int64, >= 0, back to back, ``counts`` each), each tensor's in its
    own width (``widths``: 1, 2 or 4 bytes, the bytes :func:`_encode_gaps` gives it alone), back
    to back: ``total`` bytes, in a fixed number of operations (``one``: every tensor's width,
    where they are alike)."""
    if total == 0:
        return gaps.new_empty(0, dtype=torch.uint8)
    if one is not None:
        return _narrow(gaps, one)
    width = torch.repeat_interleave(widths, counts, output_size=gaps.numel())
    end = width.cumsum(0)  # where each gap's bytes end in the output
    at = torch.arange(total, device=gaps.device)
    gap = torch.searchsorted(end, at, right=True)  # the gap of each byte written, then its byte
    at -= end.sub_(width).index_select(0, gap)
    at += gap.mul_(4)
    return gaps.to(torch.int32).view(torch.uint8).index_select(0, at)


def _read_gaps(raw: torch.Tensor, widths: torch.Tensor, counts: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` gaps (int64) of :func:`_gap_bytes`, in a fixed number of operations."""
    if count == 0:
        return raw.new_empty(0, dtype=torch.int64)
    width = torch.repeat_interleave(widths, counts, output_size=count)
    byte = _BYTE.to(raw.device)
    at = width.cumsum(0).sub_(width).unsqueeze(1) + byte  # each gap's four bytes, those past its width
    at.masked_fill_(byte >= width.unsqueeze(1), raw.numel())  # read from a zero after the end
    padded = torch.cat([raw, raw.new_zeros(1)])
    return padded.index_select(0, at.view(-1)).view(torch.int32).long()


@register_codec
class SketchML(Codec):
    """SketchML (Jiang et al., SketchML: Accelerating Distributed Machine Learning with Data
    Sketches, SIGMOD'18): quantile-bucket quantization of the values, delta-encoded keys.

    Values: a quantile sketch splits the values into ``buckets`` buckets of about equal counts;
    each value is sent as the index of its bucket (``ceil(log2(buckets))`` bits, packed; one byte
    at the default 256) and each bucket as the mean of its values (an fp32 table). A value thus
    decodes to its bucket's mean, and its error is below the bucket's width (the spread of the
    values in it). As in the paper, positive and negative values never share a bucket (a split is
    forced at zero; the two signs share the buckets in proportion to their counts), so no decoded
    value changes sign. The bucket means keep every bucket's sum, so the decoded tensor has the
    input's sum. Deterministic: no randomness.

    The sketch is a histogram over the top 18 bits of each value's fp32 pattern (sign, exponent,
    9 mantissa bits): one vectorised pass, no sort and no sampling, with quantiles exact up to a
    cell of 2**-9 relative width at any magnitude. A tensor of fewer than ``buckets`` values uses
    as many buckets as values (at least 2), so small tensors keep a small table. The histogram,
    its prefix sums and the per-bucket means are several dependent passes with atomic updates,
    so encoding stays far below a copy's speed (3.5% of a device copy on an H100, 2% on an H200;
    decode, a table lookup, 32% and 28%).

    Keys (``ratio < 1``): only the ``k = ceil(ratio * numel)`` values of largest magnitude are sent
    (top-k's selection: the radix select, ties to the lowest index), sketched by a sort of their
    keys, which for a selection costs less than a histogram of every key (the same buckets: see
    the fused group below); their indices go in increasing order as the first index (int32) followed by
    the gaps minus one in the narrowest of 1, 2 or 4 bytes that holds the largest gap, chosen per
    tensor (the paper's delta-binary key encoding, with one width per tensor). The payload size
    then depends on the data: ``fixed_size`` is false, :meth:`wire_bytes` is an upper bound (4-byte
    gaps), and choosing the width reads one scalar on the host. Dense mode (``ratio = 1``, the
    default) has a fixed size and no host sync.

    No payload exceeds the raw tensor: in dense mode a tensor whose codes and table would (fewer
    than about 340 fp32 or 680 fp16 values with 256 buckets) is sent raw, exactly (a choice by
    size alone, the same on every rank); in sparse mode a payload that would is replaced by
    its dense form, the same four tensors with the first three empty and the decoded values
    (input dtype) as the bytes of the fourth, which the decoder recognises by the empty index.
    Values sent as they are, in either mode, go in a 16-bit gradient's own width where its fp32
    compensation is encoded (:attr:`~gradzip.codecs.base.Meta.wire`).

    A fused group in dense mode (:attr:`~gradzip.codecs.base.Codec.parts_format`) is one payload
    ``[codes, means, raw values]``: each member's codes and quantile table exactly as alone,
    back to back, and the members that go as they are (those alone too, and in a group those
    of fewer values than buckets, which only fp64 members would code alone) in the input's
    dtype. On the CPU each member is sketched in turn; on an accelerator the group is taken at
    once in a fixed number of operations: one sort of the group's keys, each prefixed by its
    member's place, puts every member's values in order at places known from the layout, so
    its quantile splits are one gather (the key at a target's place is the split its histogram
    gives), one search among all splits gives each value its code, two sums by code the
    tables. The codes are those of the histogram; the tables' fp64 sums add the same values in
    another order. A payload's tables carry every NaN and ±inf of its input (the non-finite
    flag, for fp32 and 16-bit inputs).

    A fused group in sparse mode is one payload ``[codes, means, heads, gaps, raw values]``: each
    coded member's selection, quantile table, first index and gaps (in its own width) as alone,
    back to back, its codes at the group's width (``ceil(log2(buckets))`` bits: a member of fewer
    than ``buckets`` selected values has a narrower table, and alone narrower codes); ``heads``
    holds the members' first indices and then their gap widths (int32). Members whose selection
    is every value, or whose payload could not be smaller than their values, go as they are;
    where the whole payload would be larger than the group's values, the group goes as it is
    (empty heads). On an accelerator the members are selected at once (top-k's group
    selection, which waits for the device once), every member's selection is sketched by one
    sort and the members' gap widths are read on the host once (alone: a read a tensor); on the
    CPU each member is selected alone.

    Options: ``buckets`` (2..256, default 256), ``ratio`` (0 < ratio <= 1, default 1.0 = dense).
    Wire: dense ``[codes (packed uint8), means (fp32, nb)]`` with ``nb = min(buckets, numel)``;
    sparse ``[codes, means, first index (int32, 1), gaps (uint8 bytes, (k-1)·width)]``; fused
    groups as above.
    Collectives: ``allgather`` (default); ``sra`` and ``ps`` re-encode the average once more.
    ``sra`` needs the fixed-size dense mode. Default memory: ``none`` when dense (every value is
    sent; the bucket means keep each bucket's sum), ``residual`` when sparse (what top-k did not
    send is carried to later steps).
    """

    name = "sketchml"
    family = "quantization"
    paper = "Jiang et al., SketchML: Accelerating Distributed Machine Learning with Data Sketches, SIGMOD'18"
    collectives = ("allgather", "sra")
    default_memory = "none"
    options = {
        "buckets": Option(256, int_in(2, 256), "an integer in 2..256", "quantile buckets (index bits: log2)"),
        "ratio": Option(1.0, float_in(0.0, 1.0, lo_open=True), "a float in (0, 1]", "fraction of values sent"),
    }

    def __init__(self, **opts: Any) -> None:
        super().__init__(**opts)
        self._groups: Dict[Tuple[Any, ...], Any] = {}
        self._selections: Dict[int, _Group] = {}  # (sparse mode, alone)
        if self.ratio < 1.0:  # sparse: the payload size depends on the gaps between indices
            self.fixed_size = False
            self.reencodable = False  # sparse: re-selecting from the union would drop most of it
            self.collectives = ("allgather",)
            self.default_memory = "residual"

    parts_format = True  # a fused group by its parts: a quantile table (and a selection) a member

    def fused_alignment(self) -> int:
        if self.ratio < 1.0:
            return 1  # sparse: the selected values' codes go back to back
        return 1 if _index_bits(self.buckets) == 8 else 8  # each member's codes start on a whole byte

    def _sparse(self, numel: int) -> bool:
        return _k(numel, self.ratio) < numel

    def _group(self, meta: Meta) -> Any:
        """The layout of a fused group (made once per layout): a :class:`_Group` in dense mode,
        a :class:`_SparseGroup` in sparse mode; which members go as they are is decided in the
        width their values take (:attr:`Meta.wire` where given)."""
        return self._layout(meta.parts, meta.as_is)

    def _layout(self, parts: Tuple[Tuple[str, torch.Size], ...], dtype: torch.dtype) -> Any:
        key = (parts, dtype)
        grp = self._groups.get(key)
        if grp is None:
            if len(self._groups) > 256:
                self._groups.clear()
            if self.ratio < 1.0:
                grp = _SparseGroup(parts, dtype, self.buckets, self.ratio)
            else:
                grp = _Group(parts, dtype, self.buckets, self._raw, self.fused_alignment())
            self._groups[key] = grp
        return grp

    def _selection(self, k: int) -> _Group:
        """The sketch's layout of ``k`` selected values (sparse mode: a sort of their keys, which
        for a selection costs less than a histogram of every key; its table as wide as alone)."""
        grp = self._selections.get(k)
        if grp is None:
            if len(self._selections) > 256:
                self._selections.clear()
            grp = self._selections[k] = _Group(((str(k), torch.Size((k,))),), torch.float32, self.buckets,
                                             lambda n, dtype: False, 1, narrow=True)
        return grp

    def _payload_spec(self, numel: int, dtype: torch.dtype) -> Optional[List[Tuple[torch.dtype, int]]]:
        """Dense mode's form, known from the size: ``[codes, means]``; sparse mode's depends on
        the gaps (None)."""
        if self.ratio < 1.0:
            return None
        nb = _num_buckets(numel, self.buckets)
        return [(torch.uint8, packed_bytes(numel, _index_bits(nb))), (torch.float32, nb)]

    def _parts_payload_spec(self, numel: int, dtype: torch.dtype, parts: Tuple[Tuple[str, torch.Size], ...],
                            ) -> Optional[List[Tuple[torch.dtype, int]]]:
        """A dense fused group's form: ``[codes, means, raw values]``, its raw values in ``dtype``."""
        if self.ratio < 1.0:
            return None
        grp = self._layout(parts, dtype)
        return [(torch.uint8, grp.code_bytes), (torch.float32, grp.table_size), (dtype, grp.raw_count)]

    def _encode_into(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
        if meta.parts is not None:
            return self._encode_group(x, meta, out)
        return _quantize(x, _num_buckets(x.numel(), self.buckets), out)

    def _encode(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        n = x.numel()
        if meta.parts is not None:
            return self._encode_group(x, meta) if self.ratio >= 1.0 else self._encode_sparse_group(x, meta)
        if not self._sparse(n):
            return _quantize(x, _num_buckets(n, self.buckets))
        k = _k(n, self.ratio)
        idx = fused.topk(x, k)[1].sort().values  # (the radix select: ties to the lowest indices)
        levels, means = _levels_at_once(x[idx], self._selection(k))
        out = [pack_bits(levels, _index_bits(_num_buckets(k, self.buckets))), means]
        gaps = idx.diff() - 1
        out += [idx[:1].to(torch.int32), _encode_gaps(gaps)]
        if sum(t.numel() * t.element_size() for t in out) > raw_bytes(n, meta.as_is):
            # the dense form: the decoded values as the bytes of the last tensor, the rest empty
            # (in the gradient's width where given: Meta.wire)
            values = torch.zeros(n, dtype=meta.as_is, device=x.device)
            values.index_copy_(0, idx, saturate(_dequantize(out[0], out[1], k), meta.as_is))
            return [t.new_empty(0) for t in out[:3]] + [values.view(torch.uint8)]
        return out

    def _encode_group(self, x: torch.Tensor, meta: Meta, out: Optional[List[torch.Tensor]] = None,
                      ) -> List[torch.Tensor]:
        """A fused group: ``[codes, means, raw values]`` (into ``out`` where given), each member
        coded with its own quantile table (its codes and table as alone) or sent as it is (where
        it would be alone). On the CPU member by member, each straight into its place; on an
        accelerator at once (:meth:`_sketch_at_once`)."""
        grp = self._group(meta)
        if fused.groups_at_once(x.device):
            made = list(self._sketch_at_once(x, grp)) + [as_wire(grp.gather_raw(x), meta.wire)]
            return made if out is None else [o.copy_(t) for o, t in zip(out, made)]
        codes, means, raw = out if out is not None else (
            torch.empty(grp.code_bytes, dtype=torch.uint8, device=x.device),
            torch.empty(grp.table_size, dtype=torch.float32, device=x.device), None)
        for (a, n, o), (t, nb) in zip(grp.coded, grp.tables):
            _quantize(x[a : a + n], nb, [codes[o : o + packed_bytes(n, grp.bits)], means[t : t + nb]])
        if raw is None:
            return [codes, means, as_wire(grp.gather_raw(x), meta.wire)]
        at = 0
        for a, n in grp.raws:  # (a member at a time: the casts are a member long)
            raw[at : at + n] = as_wire(x[a : a + n], meta.wire)
            at += n
        return [codes, means, raw]

    @staticmethod
    def _sketch_at_once(x: torch.Tensor, grp: _Group) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every coded member's codes (packed) and table in a fixed number of operations,
        whatever the members (the class docstring says how)."""
        g = grp.on(x.device)
        levels, means = _levels_at_once(x, grp)
        packed = pack_bits(levels, grp.bits)
        mine = [(at, size) for own, _, at, size in g["runs"] if own]
        if mine == [(0, packed.numel())]:
            return packed, means
        return torch.cat([packed[at : at + size] for at, size in mine] or [packed[:0]]), means

    def _encode_sparse_group(self, x: torch.Tensor, meta: Meta) -> List[torch.Tensor]:
        """A fused sparse group: ``[codes, means, heads, gaps, raw values]`` (the class docstring
        says what each holds), or every value as it is where that is smaller (``heads`` empty).
        Each coded member's selection, table and gaps are its own alone; the codes are packed at
        the group's width. The sketch is one sort on any device; the selections are taken at once
        on an accelerator (top-k's group selection, which waits for the device once, and the
        gaps' widths, read on the host), member by member on the CPU."""
        lay = self._group(meta)
        g, dev = lay.on(x.device), x.device
        at_once = fused.groups_at_once(dev)
        sel = _group_topk(x, meta.parts, self.ratio) if at_once and lay.coded else None
        if sel is not None:  # every member's, largest first: ascending, members in turn
            sel = sel.sort().values
            sel = sel if g["keep"] is None else sel.index_select(0, g["keep"])
        else:  # (the CPU's way, and where a member has too few candidates)
            picks = [fused.topk(x[a : a + n], k)[1].sort().values.add_(a) for a, n, k in lay.coded]
            sel = torch.cat(picks) if picks else torch.empty(0, dtype=torch.int64, device=dev)
        values = x.index_select(0, sel)
        levels, means = _levels_at_once(values, lay.sketch)
        gaps = sel.diff().sub_(1)
        gaps = gaps if g["gap_from"] is None else gaps.index_select(0, g["gap_from"])
        largest = torch.zeros(len(lay.coded), dtype=torch.int64, device=dev)
        member = torch.repeat_interleave(g["members"], g["gap_counts"], output_size=lay.gap_count)
        largest = largest.scatter_reduce_(0, member, gaps, "amax").tolist()  # (a host read: the widths)
        widths = [_gap_width(m) for m in largest]
        gap_bytes = sum(w * (k - 1) for w, (_, _, k) in zip(widths, lay.coded))
        codes = pack_bits(levels, lay.bits)
        size = codes.numel() + 4 * means.numel() + 8 * len(lay.coded) + gap_bytes + lay.raw_bytes
        if size > raw_bytes(lay.numel, meta.as_is):  # every value as it is (a choice by the data, told by empty heads)
            none = x.new_empty(0, dtype=torch.uint8)
            return [none, x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.int32), none, as_wire(x, meta.wire)]
        width = ints_on(widths, dev)  # (no second host wait: the widths were just read there)
        heads = torch.cat([sel.index_select(0, g["firsts"]).sub_(g["starts"]), width]).to(torch.int32)
        raw = x.new_empty(0) if g["raw_index"] is None else as_wire(x.index_select(0, g["raw_index"]), meta.wire)
        gaps = _gap_bytes(gaps, width, g["gap_counts"], gap_bytes, lay.one_width(widths))
        return [codes, means, heads, gaps, raw]

    def _decode_sparse_group(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor,
                             accumulate: bool) -> torch.Tensor:
        """A fused sparse group's payload into the flat ``out`` (its first ``out.numel()``
        values; added to it with ``accumulate``), in a fixed number of operations on any device."""
        lay, (codes, means, heads, gaps, raw) = self._group(meta), tensors
        numel = out.numel()
        if heads.numel() == 0:  # every value as it is
            return store_into(raw[:numel].to(out.dtype), out, accumulate)
        g, c = lay.on(out.device), len(lay.coded)
        full = out if numel == lay.numel else torch.zeros(lay.numel, dtype=out.dtype, device=out.device)
        if full is out and not accumulate:
            out.zero_()
        firsts = heads[:c].long().add_(g["starts"])  # each member's first index in the group
        # (the CPU reads the widths for nothing: where they are alike, one cast)
        if not fused.groups_at_once(out.device) and lay.one_width(heads[c:].tolist()) is not None:
            steps = _decode_gaps(gaps, lay.gap_count)
        else:
            steps = _read_gaps(gaps, heads[c:].long(), g["gap_counts"], lay.gap_count)
        steps += 1
        at = torch.empty(lay.selected, dtype=torch.int64, device=out.device)
        gap_to = g["gap_from"].long().add_(1) if g["gap_from"] is not None else torch.arange(1, lay.selected, device=out.device)
        at.index_copy_(0, gap_to, steps).index_copy_(0, g["firsts"], firsts)
        at = at.cumsum_(0)
        before = at.index_select(0, g["firsts"]).sub_(firsts)  # the sum of the members before, each one's
        at -= torch.repeat_interleave(before, g["counts"], output_size=lay.selected)
        table = torch.repeat_interleave(g["table_starts"], g["counts"], output_size=lay.selected)
        table += unpack_bits(codes, lay.bits, lay.selected)
        values = means.index_select(0, table).to(out.dtype)
        if accumulate and full is out:
            out.index_add_(0, at, values)
        else:
            full.index_copy_(0, at, values)
        if g["raw_index"] is not None and accumulate and full is out:
            out.index_add_(0, g["raw_index"], raw.to(out.dtype))
        elif g["raw_index"] is not None:
            full.index_copy_(0, g["raw_index"], raw.to(out.dtype))
        return out if full is out else store_into(full[:numel], out, accumulate)

    def _decode_group(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """A fused group's payload into the flat fp32 (or, for fp64 inputs, fp64) ``out``: its first
        ``out.numel()`` values, padding decoded to 0."""
        grp, (codes, means, raw) = self._group(meta), tensors
        numel, bits = out.numel(), grp.bits
        if fused.groups_at_once(codes.device):  # the whole group's codes, then one lookup
            g = grp.on(codes.device)
            pieces = [codes[o : o + size] if own else g["zeros"][:size] for own, o, _, size in g["runs"]]
            index = torch.repeat_interleave(g["dec_base"], g["lengths"], output_size=grp.numel)
            index += unpack_bits(pieces[0] if len(pieces) == 1 else torch.cat(pieces), bits, grp.numel)
            table = torch.cat([means, means.new_zeros(1)]).to(out.dtype)  # (the codes not coded point at a 0)
            whole = numel == grp.numel and not accumulate
            values = torch.index_select(table, 0, index, out=out) if whole else table.index_select(0, index)
            if g["raw_index"] is not None:
                values.index_copy_(0, g["raw_index"], raw.to(values.dtype))
            return out if whole else store_into(values[:numel], out, accumulate)
        spans = [(a, n, None, j) for j, (a, n, _) in enumerate(grp.coded)]
        at = 0
        for a, n in grp.raws:
            spans.append((a, n, raw[at : at + n].to(out.dtype), None))  # (as the lookup above casts them)
            at += n
        for a, n, values, j in spans:
            m = min(n, numel - a)
            if m <= 0:
                continue
            if values is None:  # (straight into its place)
                o, (t, nb) = grp.coded[j][2], grp.tables[j]
                _dequantize(codes[o : o + packed_bytes(n, bits)], means[t : t + nb], m, out[a : a + m], accumulate)
            else:
                store_into(values[:m], out[a : a + m], accumulate)
        if not accumulate:
            for a, n in grp.spans:
                out[a + n : min(a + n + (-n % grp.align), numel)].zero_()
        return out

    def nonfinite(self, payload: Payload) -> Optional[torch.Tensor]:
        """From the tables (and a group's values sent as they are): a bucket's mean is an fp64
        sum of its fp32 values, so it is NaN or infinite exactly where they held NaN or Inf.
        In sparse mode a NaN or ±inf has the largest magnitude, so a member's selection holds
        every one of them, or nothing else: its table tells too. None for fp64 inputs (a finite
        value beyond fp32's range becomes infinite in the sketch), payloads sent raw and the
        dense form of a sparse one."""
        t = payload.tensors
        if payload.ctx.dtype == torch.float64 or len(t) not in (2, 3, 4, 5) or (len(t) == 4 and not t[2].numel()):
            return None
        flag = stats_nonfinite(payload, 1)
        raw = {3: 2, 5: 4}.get(len(t))  # a group's values sent as they are
        return flag | stats_nonfinite(payload, raw) if raw is not None and t[raw].numel() else flag

    def _raw(self, numel: int, dtype: torch.dtype) -> bool:
        # by size alone in dense mode (fixed size even when ratio < 1); sparse: the dense form
        return not self._sparse(numel) and self._wire_bytes(numel, dtype) > raw_bytes(numel, dtype)

    def _decode(self, tensors: List[torch.Tensor], meta: Meta) -> torch.Tensor:
        n = meta.numel
        if meta.parts is not None:  # (fp64: its members sent as they are stay exact)
            out = torch.empty(n, dtype=torch.float64 if meta.dtype == torch.float64 else torch.float32,
                              device=tensors[-1].device)
            if self.ratio < 1.0:
                return self._decode_sparse_group(tensors, meta, out, False)
            return self._decode_group(tensors, meta, out, False)
        if not self._sparse(n):
            return _dequantize(tensors[0], tensors[1], n)
        packed, means, first, raw = tensors
        if first.numel() == 0:  # the dense form
            return raw.view(meta.as_is)
        k = _k(n, self.ratio)
        values = _dequantize(packed, means, k)
        steps = _decode_gaps(raw, k - 1).add_(1)
        idx = torch.cat([first.to(torch.int64), steps]).cumsum_(0)
        return torch.zeros(n, dtype=values.dtype, device=values.device).index_copy_(0, idx, values)

    def _decode_into(self, tensors: List[torch.Tensor], meta: Meta, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
        if out.is_contiguous() and out.dtype == torch.float32:
            if meta.parts is not None:
                if self.ratio < 1.0:
                    self._decode_sparse_group(tensors, meta, out.view(-1), accumulate)
                else:
                    self._decode_group(tensors, meta, out.view(-1), accumulate)
                return out
            if not self._sparse(meta.numel):  # every value coded: straight into ``out``
                _dequantize(tensors[0], tensors[1], out.numel(), out.view(-1), accumulate)
                return out
        return super()._decode_into(tensors, meta, out, accumulate)

    def _wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        count = _k(numel, self.ratio) if self._sparse(numel) else numel
        nb = _num_buckets(count, self.buckets)
        wire = packed_bytes(count, _index_bits(nb)) + 4 * nb
        if count < numel:
            wire += 4 + 4 * (count - 1)  # first index and the widest gaps: an upper bound
            wire = min(wire, raw_bytes(numel, dtype))  # else the dense form
        return wire


def _levels_at_once(x: torch.Tensor, grp: _Group) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every value's code in its member's table (uint8; 0 for the values not coded) and the
    coded members' tables back to back, for a group laid out as ``grp`` says, in a fixed number
    of operations (see :meth:`SketchML._encode_group`)."""
    g, n, stride = grp.on(x.device), x.numel(), 1 << grp.bits
    xf = x.float()
    keyed = torch.repeat_interleave(g["prefix"], g["lengths"], output_size=n)
    keyed += _sortable_keys(xf)
    quantiles = torch.sort(keyed).values.index_select(0, g["positions"])  # (the sorted keys let go at once)
    splits = torch.cat([g["fixed"], quantiles]).sort().values
    # the number of splits at or below a key: stride for each member before, the member's own
    # first key and those of its own splits at or below it (its code)
    code = torch.searchsorted(splits, keyed, right=True, out_int32=True).sub_(1)
    del keyed  # (each group-long temporary let go once read)
    sums = torch.zeros(g["cells"], dtype=torch.float64, device=x.device).index_add_(0, code, xf.double())
    one = torch.ones(1, dtype=torch.float64, device=x.device)
    counts = torch.zeros(g["cells"], dtype=torch.float64, device=x.device).index_add_(0, code, one.expand(n))
    means = sums.div_(counts.clamp_min_(1)).float()
    if g["tables"] is None:  # every member's table as wide: a view of the cells
        means = means.view(-1, stride)[:-1, : grp.nb].reshape(-1)
    else:
        means = means.index_select(0, g["tables"])
    return code.bitwise_and_(stride - 1).to(torch.uint8), means


class _Group:
    """Where each member of a fused dense SketchML group goes, made once per layout: the members
    coded, each with its own quantile table (``coded``: start, values, and where its codes lie in
    the payload's), and those sent as they are (``raws``: where a member alone would be); the
    payload is ``[codes, means, raw values]``, the coded members' codes and tables back to back,
    each exactly as alone. For taking the group at once (:meth:`on`), the tensors of its sort."""

    def __init__(self, parts: Tuple[Tuple[str, torch.Size], ...], dtype: torch.dtype, buckets: int,
                 raw: Callable[[int, torch.dtype], bool], align: int, narrow: bool = False) -> None:
        spans = part_spans(parts, align)
        self.numel = sum(n + (-n % align) for _, n in spans)
        self.nb = buckets
        self.bits = _index_bits(buckets)
        self.coded: List[Tuple[int, int, int]] = []  # (start, values, first byte of its codes in the payload's)
        self.tables: List[Tuple[int, int]] = []  # each coded member's table: (first mean, buckets)
        self.raws: List[Tuple[int, int]] = []
        at = means = 0
        for a, n in spans:
            # (a member of fewer values than buckets, whose table would be narrower, is sent as
            # it is: alone it is too, but for fp64 values, which it then sends exactly; with
            # ``narrow`` it is coded with the narrower table it has alone)
            if n and (raw(n, dtype) or (n < buckets and not narrow)):
                self.raws.append((a, n))
            elif n:
                self.coded.append((a, n, at))
                self.tables.append((means, _num_buckets(n, buckets)))
                at += packed_bytes(n, self.bits)
                means += self.tables[-1][1]
        self.code_bytes, self.table_size = at, means
        self.raw_count = sum(n for _, n in self.raws)
        self.spans, self.align = spans, align
        self._on: Dict[torch.device, Dict[str, Any]] = {}

    def gather_raw(self, x: torch.Tensor) -> torch.Tensor:
        """The members sent as they are, back to back, in ``x``'s dtype (empty when none): on
        the CPU a slice a member, elsewhere one gather."""
        if not self.raws:
            return x.new_empty(0)
        if fused.groups_at_once(x.device):
            return x.index_select(0, self.on(x.device)["raw_index"])
        return torch.cat([x[a : a + n] for a, n in self.raws])

    def on(self, device: torch.device) -> Dict[str, Any]:
        """The group's sort on ``device``: each value keyed by its member's place (coded members
        in turn, then one last "member" for the values not coded: those sent as they are and
        the padding) above its 18-bit key, so that one sort puts each member's values in order
        at known places; where each member's quantile targets lie in that order; and the
        splits every member has whatever its values (see :meth:`SketchML._encode_group`)."""
        got = self._on.get(device)
        if got is not None:
            return got
        c, stride = len(self.coded), 1 << self.bits
        wide = torch.int32 if (c + 1) << KEY_BITS < 2**31 else torch.int64
        prefix, dec_base, lengths = [], [], []

        def segment(p: int, base: int, n: int) -> None:
            if n and prefix and prefix[-1] == p and dec_base[-1] == base:
                lengths[-1] += n
            elif n:
                prefix.append(p), dec_base.append(base), lengths.append(n)

        coded = {a: j for j, (a, _, _) in enumerate(self.coded)}
        for a, n in self.spans:
            j = coded.get(a) if n else None
            if j is None:
                segment(c << KEY_BITS, self.table_size, n + (-n % self.align))
            else:
                segment(j << KEY_BITS, self.tables[j][0], n)
                segment(c << KEY_BITS, self.table_size, -n % self.align)
        positions, at = [], 0
        for (_, n, _), (_, nb) in zip(self.coded, self.tables):
            positions.append(_targets(n, nb, torch.device("cpu")).long() + at)
            at += n
        # each member j has ``stride`` splits: its first key (below every key of its own), the
        # split at +0.0, its nb - 2 quantile splits and ``stride - nb`` copies of the next
        # member's first key (above every key of its own), so that the splits at or below one
        # of its keys number j * stride + 1 + its code; the last "member" has its first key
        fixed = [torch.tensor([j << KEY_BITS] + [(j + 1) << KEY_BITS] * (stride - nb)) for j, (_, nb) in enumerate(self.tables)]
        fixed.append(torch.tensor([c << KEY_BITS]))
        fixed.append(torch.arange(c, dtype=torch.int64).mul_(1 << KEY_BITS).add_(_ZERO_KEY))
        uniform = all(nb == self.nb for _, nb in self.tables)  # (else each member's table by its cells)
        cells = [torch.arange(j * stride, j * stride + nb) for j, (_, nb) in enumerate(self.tables)]
        raw_index = [torch.arange(a, a + n) for a, n in self.raws]
        # (members on whole bytes of codes: a sparse group's selections, back to back, have none)
        runs = self._runs() if self.bits == 8 or self.align % 8 == 0 else []
        got = self._on[device] = {
            "prefix": torch.tensor(prefix, dtype=wide, device=device),
            "dec_base": torch.tensor(dec_base, dtype=torch.int32, device=device),
            "lengths": torch.tensor(lengths, dtype=torch.int64, device=device),
            "positions": torch.cat(positions or [torch.empty(0, dtype=torch.int64)]).to(device),
            "fixed": torch.cat(fixed).to(wide).to(device),
            "cells": (c + 1) * stride,
            "tables": None if uniform else torch.cat(cells or [torch.empty(0, dtype=torch.int64)]).to(device),
            "raw_index": torch.cat(raw_index).to(device) if raw_index else None,
            "runs": runs,
            "zeros": torch.zeros(max([size for mine, _, _, size in runs if not mine], default=0),
                                 dtype=torch.uint8, device=device),
        }
        return got

    def _runs(self) -> List[Tuple[bool, int, int, int]]:
        """The codes of the whole group (:func:`pack_bits` of every value, padding included) as
        pieces: ``(from the payload's codes, start there, start in the whole, bytes)``, zeros
        where no member is coded (members sent as they are; 8-bit codes of padding)."""
        runs: List[Tuple[bool, int, int, int]] = []
        at = 0  # bytes of the whole group's codes so far
        for a, n, o in self.coded:
            start, size = packed_bytes(a, self.bits), packed_bytes(n, self.bits)  # (a member starts on a whole byte)
            if start > at:
                runs.append((False, 0, at, start - at))
            if runs and runs[-1][0] and runs[-1][2] + runs[-1][3] == start:
                runs[-1] = runs[-1][:3] + (runs[-1][3] + size,)
            else:
                runs.append((True, o, start, size))
            at = start + size
        total = packed_bytes(self.numel, self.bits)
        if total > at:
            runs.append((False, 0, at, total - at))
        return runs


class _SparseGroup:
    """Where each member of a fused sparse SketchML group goes, made once per layout: the members
    coded (``coded``: start, values, ``k``), each with its own ``k`` largest selected and
    sketched as alone, their selections back to back (member j's from ``offsets[j]``; the
    sketch's layout over them, ``sketch``, gives each its table as wide as alone), and the
    members sent as they are (``raws``: those whose selection would be every value, or whose
    payload could not be smaller than their values). For taking the group at once
    (:meth:`on`), the places of each member's selection, gaps and table."""

    def __init__(self, parts: Tuple[Tuple[str, torch.Size], ...], dtype: torch.dtype, buckets: int, ratio: float) -> None:
        spans = part_spans(parts, 1)
        self.numel = sum(n for _, n in spans)
        self.bits = _index_bits(buckets)
        self.coded: List[Tuple[int, int, int]] = []
        self.raws: List[Tuple[int, int]] = []
        self._chosen: List[Tuple[int, int]] = []  # (first place, k) of each coded member's among every member's selections
        chosen = 0
        for a, n in spans:
            k = _k(n, ratio) if n else 0
            # its smallest payload: codes, table, first index and width, one-byte gaps
            least = -(-k * self.bits // 8) + 4 * _num_buckets(k, buckets) + 8 + (k - 1)
            if n and k < n and least <= raw_bytes(n, dtype):
                self.coded.append((a, n, k))
                self._chosen.append((chosen, k))
            elif n:
                self.raws.append((a, n))
            chosen += k
        selections = tuple((str(j), torch.Size((k,))) for j, (_, _, k) in enumerate(self.coded))
        self.sketch = _Group(selections, torch.float32, buckets, lambda n, dtype: False, 1, narrow=True)
        self.offsets = [at for at, _, _ in self.sketch.coded]  # (every selection coded, back to back)
        self.selected = self.sketch.numel
        self.gap_count = sum(k - 1 for _, _, k in self.coded)
        self.raw_bytes = sum(raw_bytes(n, dtype) for _, n in self.raws)
        self._on: Dict[torch.device, Dict[str, Any]] = {}

    def one_width(self, widths: List[int]) -> Optional[int]:
        """The gap width every coded member has (a member of one value, with no gaps, aside),
        or None where they differ."""
        alike = {w for w, (_, _, k) in zip(widths, self.coded) if k > 1}
        return alike.pop() if len(alike) == 1 else None

    def on(self, device: torch.device) -> Dict[str, Any]:
        got = self._on.get(device)
        if got is not None:
            return got

        def ranges(pairs: List[Tuple[int, int]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.cat([torch.arange(a, a + n) for a, n in pairs] or [torch.empty(0, dtype=torch.int64)]).to(device, dtype)

        ks = [k for _, _, k in self.coded]
        gaps = [(p, k - 1) for p, k in zip(self.offsets, ks)]
        got = self._on[device] = {
            # (int32 where a gather reads them: a layout's tensors a selected value long are 4 to 8 bytes
            # a value; the other places are made when needed)
            # the coded members' places among every member's selections (None: no other)
            "keep": ranges(self._chosen, torch.int32) if self.raws else None,
            # each member's gaps among the selection's differences (they add up one place on)
            "gap_from": ranges(gaps, torch.int32) if len(ks) > 1 else None,
            "members": torch.arange(len(ks), device=device),
            "gap_counts": torch.tensor([g for _, g in gaps], dtype=torch.int64, device=device),
            "counts": torch.tensor(ks, dtype=torch.int64, device=device),
            "firsts": torch.tensor(self.offsets, dtype=torch.int64, device=device),
            "starts": torch.tensor([a for a, _, _ in self.coded], dtype=torch.int64, device=device),
            "table_starts": torch.tensor([t for t, _ in self.sketch.tables], dtype=torch.int32, device=device),
            "raw_index": ranges(self.raws) if self.raws else None,
        }
        return got
