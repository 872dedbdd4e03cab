"""The fused paths of the engine: a group of gradients averaged as one flat buffer.

The unit of exchange is a fused group (a DDP bucket, or a planned group of a few MB), not a
tensor: its gradients are compensated into one buffer lent by the engine's pool (or averaged in
the DDP bucket's own memory), encoded and exchanged once, and the average copied back, with a
number of operations that does not grow with the number of gradients on an accelerator. The
plain gradients of a job go in one sum. :class:`FusedGroups` holds these paths as methods of
:class:`~gradzip.sync.engine.Communicator`, which provides the codec, memory, collectives and
the pools, layouts and residuals they use (see its constructor).
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..codecs.base import FLOAT_DTYPES, Codec
from ..comm.base import Collective
from ..comm.pool import BufferPool, size_class
from ..kernels.rng import stable_hash
from . import device as _device
from .groups import FusedLayout, group_key
from .memory import wire_of
from .metrics import record_of
from .pipeline import Stages, lockstep, staged
from .places import Places
from .settle import (
    IN_PLACE_MEMORIES, input_read_after, late_out, poison_if, residual_settles, scratch_for, settle_remade,
    settle_residual,
)


class FusedGroups:
    """The fused-group, plain-sum and bucket-in-place paths of :class:`~gradzip.sync.engine.Communicator`."""

    def _reduce_plain(self, tensors: Sequence[torch.Tensor], names: Sequence[str], inplace: bool, step: int) -> Stages:
        """One plain all-reduce of uncompressed gradients of one dtype: in place where they lie
        back to back in one buffer (a whole DDP bucket left plain), else concatenated."""
        span = contiguous_span(tensors) if inplace else None
        numel = sum(t.numel() for t in tensors)
        if inplace and numel and not self.plain_goes_hierarchical(numel, tensors[0].element_size()):
            return (yield from self._plain_sum(tensors, names, step, span))
        if span is not None:  # the hierarchical all-reduce, in place
            avg, record = yield from self._reduce(span, f"uncompressed:{names[0]}", False, span, step)
            self.metrics.record_group([(n, t.numel() * span.element_size()) for n, t in zip(names, tensors)], **record)
            return list(tensors)
        if len(tensors) > 1:  # one concatenation, its loop in C++
            flat = _flatten_dense_tensors(tensors)
        else:  # (of one tensor that would be a view, not a copy)
            flat = torch.cat([tensors[0].reshape(-1)])
        avg, record = yield from self._reduce(flat, f"uncompressed:{names[0]}", False, None, step)
        self.metrics.record_group([(n, t.numel() * flat.element_size()) for n, t in zip(names, tensors)], **record)
        out = _unflatten_dense_tensors(avg, tensors)  # views of the average shaped as the gradients
        if inplace:  # one multi-tensor copy into the gradients
            copy_all(tensors, out)
            return list(tensors)
        return list(out)

    def _plain_sum(self, tensors: Sequence[torch.Tensor], names: Sequence[str], step: int,
                   span: Optional[torch.Tensor] = None) -> Stages:
        """The flat plain sum of gradients of one dtype, averaged into them, as DDP's own hook
        makes it: divided by the world size and all-reduced in place, where they lie back to
        back (``span``: the memory they fill), else in a buffer of the pool they are copied
        into and back out of; the values of the plain collective's path (the same division,
        the same sum), without its codec, payload and call objects, which cost the worker's
        host time a job, and with nothing allocated from step to step."""
        w = self.world_size
        pool, lent = self._pool(tensors[0].dtype, step), []
        views = sources = None
        if span is None:  # the gradients' places in the buffer: kept from step to step, as a fused group's
            layout = self._fused_layout(tensors, names, 1, step)
            flat = pool.lend((layout.total,), tensors[0].device, lent)
            views, sources = layout.views(flat, "plain"), [tensors[i] for i in layout.order]
        else:
            flat = span
        try:
            if views is not None:  # one multi-tensor copy in, one out
                copy_all(views, sources)
            if w > 1:
                work = dist.all_reduce(flat.div_(w), group=self.group, async_op=True)
                yield  # the sum is on the wire
                work.wait()
            if views is not None:
                copy_all(sources, views)
        finally:
            pool.give_back(lent)
        nbytes = flat.numel() * flat.element_size()
        self.metrics.record_group(
            [(n, t.numel() * t.element_size()) for n, t in zip(names, tensors)], wire=nbytes, encode_s=0.0,
            decode_s=0.0, compressed=False, sent=self._plain.sent_per_byte(w) * nbytes, codec=self._plain_codec.name,
        )
        return list(tensors)

    def _fusable(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> bool:
        """Whether these gradients go through the codec as one fused buffer (see :meth:`_reduce_fused`):
        a codec with independent blocks, or one that encodes a buffer by its parts
        (:attr:`Codec.parts_format`, PowerSGD) where the collective hands them over."""
        align = self.codec.fused_alignment()
        if not self.fusion or not tensors or align <= 0 or not any(t.numel() for t in tensors):
            return False  # (a group of empty gradients only: each its own empty exchange, no buffer of none)
        codec = self.codec_for(names[0])  # (a group holds one level: the plan's)
        if codec.parts_format and (len(tensors) < 2 or not all(
            self.codec_for(n) is codec and self.collective_for(n).carries_parts for n in names
        )):
            return False  # (one alone joins the others of its job in one batch: :meth:`_reduce_batched`)
        first = tensors[0]
        if len(tensors) == 1 and not (
            self.memory.stateful and residual_settles(self.memory, torch.float32)
            and first.numel() % align == 0
        ):
            return False  # alone, without error feedback or not a whole number of blocks: exchanged where it lies
        return all(t.dtype == first.dtype and t.device == first.device for t in tensors)

    def _reduce_fused(self, tensors: Sequence[torch.Tensor], names: Sequence[str], inplace: bool, step: int) -> Stages:
        """One encode, one exchange and one decode for several gradients (CGX's fused buffers).

        Each error-compensated gradient is copied into a flat buffer at an offset that is a
        multiple of the codec's block (:meth:`Codec.fusion_block`), the gap after it zeroed, and
        the collective cuts its chunks on block boundaries too: every block holds values of one
        gradient only, so the bytes are those of the gradients encoded one by one, less the
        per-call overhead. The layout is canonical (gradients sorted by name), so it does not
        depend on the order in which DDP put them into its bucket, and neither does the
        randomness keyed by the group's name. Residuals stay per parameter name (slices of the
        buffer), so checkpoints and DDP's bucket rebuild are unaffected. One non-finite flag
        covers the group: a NaN in one gradient makes every gradient of the group NaN.
        """
        codec, coll, mem = self.codec_for(names[0]), self.collective_for(names[0]), self.memory
        started = time.perf_counter()
        block = codec.fused_alignment()
        # (a gradient alone keeps its length: it may be averaged where it lies, see below)
        layout = self._fused_layout(tensors, names, block, step, coll if len(tensors) > 1 else None)
        order, spans, total, key = layout.order, layout.spans, layout.total, layout.key
        # the codec's input dtype: the memory's (fp32 residuals) or the gradients'
        dtype = mem.input_dtype(tensors[order[0]].dtype)
        pool = self._pool(dtype, step)
        lent: List[torch.Tensor] = []  # the group's buffers, the pool's again once the averages are out
        lent_input: List[torch.Tensor] = []  # the input's buffer where it goes back once read (see late_out)
        # the collective's own staging memory where it has some (the node's shared memory of a
        # hierarchical exchange), else a buffer of the pool
        flat = coll.input_buffer(key, total, dtype, tensors[0].device, step, align=block)
        # a gradient alone whose input is its own memory compensated in place (the average
        # overwrites it anyway): no copy in or out, no buffer of its size from the pool
        alone = flat is None and inplace and self._averaged_where_it_lies(tensors, total, dtype, coll)
        # error feedback that is a residual settled when the collective releases the input
        settles = mem.stateful and coll.releases_input and residual_settles(mem, dtype)
        late = None
        # nothing reads the input once it is encoded (no error feedback) or once the exchange
        # releases it (a residual settled then): where the collective says when that is, its
        # buffer serves other groups until this one's average is written (then lent again), so
        # the groups in flight do not each hold one
        early = coll.reads_input_first and coll.releases_input and (settles or not input_read_after(mem, coll))
        if alone:
            flat = tensors[0].view(-1)
        elif flat is None:
            flat = pool.lend((total,), tensors[0].device, lent_input if early else lent)
            if early:
                # with error feedback the input is made again when the residual settles (the
                # gradients and the old residual are intact until then), so the groups in
                # flight hold no input buffer while their payloads are on the wire
                late = late_out(pool, lent_input, lent, flat, remade=settles)
        residual = None

        def compensate(buf: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
            """The codec's input written into ``buf`` (``views``: the gradients' places in it):
            on an accelerator a few operations for the whole group, whatever its size, where the
            memory is none or the group's residual; else the memory's own, gradient by gradient
            (on the CPU one pass each, where a call costs next to nothing). The padding is zeroed."""
            if _device.multi_tensor(buf.device) and (residual is not None or not mem.stateful):
                if not alone:
                    copy_all(views, [tensors[i] for i in order])
                if residual is not None:
                    if mem.gamma != 1.0:
                        buf.mul_(mem.gamma)
                    buf.add_(residual, alpha=mem.beta)
            else:  # (a memory may take the group in a few multi-tensor operations: DGC's on an accelerator)
                mem.compensate_many_into([tensors[i] for i in order], [names[i] for i in order], views)
            self._places_of(buf.device, layout.gaps).fill_(buf, 0)

        def remake(held: List[torch.Tensor]) -> torch.Tensor:
            """The input again, the same operations on the same values (the same bits), in a
            buffer of the pool lent into ``held``; the input itself where the collective read
            it until it released it (PowerSGD's rounds), so it is still lent and intact."""
            if lent_input:
                return flat
            buf = pool.lend((total,), flat.device, held)
            compensate(buf, layout.views(buf, "input"))
            return buf

        try:
            inputs = layout.views(flat, "input", keep=not alone)  # in the order of the layout (no view of DDP's memory kept)
            # the average overwrites the input buffer when the collective has read it by then and
            # error feedback, if any, is a residual settled at that moment (see settle_residual)
            settle = None
            if settles:
                members = [(names[i], (start, n), tensors[i].shape) for i, (start, n) in zip(order, spans)]
                residual = self._group_residual(key, flat, members)
                if late is not None:
                    settle = settle_remade(residual, remake, pool)
                else:
                    settle = settle_residual(residual, scratch_for(flat, pool, lent))
            compensate(flat, inputs)
            self._observe(layout.names, inputs, step)
            if late is not None:
                out = None
            elif coll.releases_input and (settle is not None or not input_read_after(mem, coll)):
                out = flat
            else:  # the input is still read after the exchange: the average needs a buffer of its own
                out = pool.lend((total,), flat.device, lent)
            res = yield from staged(coll.stages(
                codec, flat, key, step, need_own=mem.stateful, out=out, align=block, on_release=settle,
                parts=layout.parts if codec.parts_format else None, late=late,
                wire=wire_of(tensors[order[0]], flat),
            ))
            if mem.stateful and settle is None:  # one flag covers the group
                own = layout.views(res.own, "own", keep=False)
                mem.update_many(layout.names, inputs, own, skip=res.nonfinite)
            avg = poison_if(res.avg, res)
            if not inplace:  # the caller's own copy (the buffer goes back to the pool), in its dtype
                avg = avg.to(tensors[0].dtype, copy=True)
            if inplace:  # one multi-tensor copy into DDP's views
                # (the average's views are kept where it lies in the group's own buffer: a
                # result lent late is one of the group's pool)
                own_buffer = late is not None or (avg.data_ptr() == out.data_ptr() and avg.numel() == out.numel())
                if not (alone and own_buffer):  # (alone, it is there already)
                    copy_all([tensors[i] for i in order], layout.views(avg, "average", keep=own_buffer))
                results = list(tensors)
            else:  # views of the caller's copy, in the gradients' own order
                results = [None] * len(tensors)  # type: ignore[list-item]
                for i, view in zip(order, layout.views(avg, "average", keep=False)):
                    results[i] = view
            wire = res.wire_bytes if res.payload_bytes is None else res.payload_bytes
            record = record_of(res, wire, coll.sent_per_byte(self.world_size), True, codec)
            self.metrics.record_group(layout.members(tensors[0].element_size()), **record)
            self.metrics.record_group_time(key, time.perf_counter() - started)
            return results
        finally:
            pool.give_back(lent_input)
            pool.give_back(lent)

    def _averaged_where_it_lies(self, tensors: Sequence[torch.Tensor], total: int, dtype: torch.dtype,
                                coll: Collective) -> bool:
        """Whether a group of one gradient can be its own buffer: contiguous, of the codec's input
        dtype and a whole number of blocks (no padding), with a collective that releases its input
        before writing the average and a residual settled at that moment (error feedback is why a
        gradient alone is fused at all: see :meth:`_fusable`)."""
        t, mem = tensors[0], self.memory
        return (len(tensors) == 1 and t.is_contiguous() and t.dtype == dtype and t.numel() == total
                and mem.stateful and coll.releases_input and residual_settles(mem, dtype))

    def _fused_layout(self, tensors: Sequence[torch.Tensor], names: Sequence[str], block: int, step: int,
                      coll: Optional[Collective] = None) -> FusedLayout:
        """The layout of a fused group in its flat buffer (:class:`FusedLayout`), made once per
        group (its members' names and shapes, the codec's block, and the collective ``coll``
        that sets its length: :meth:`~gradzip.comm.base.Collective.fused_length`); marked used
        at ``step`` (see :meth:`_prune_layouts`)."""
        shapes = tuple(t.shape for t in tensors)
        ident = (tuple(names), shapes, block, None if coll is None else id(coll))
        layout = self._fused_layouts.get(ident)
        if layout is None:
            device = tensors[0].device

            def length(n: int) -> int:
                # the collective's length, unless it takes a larger size class of the pools
                # (ResNet-50's 2^21-value groups at three ranks): a buffer 19% larger, held,
                # costs more than the copy of a chunk that the collective pads
                padded = coll.fused_length(n, block, device)
                return padded if size_class(padded) == size_class(n) else n

            layout = self._fused_layouts[ident] = FusedLayout(
                shapes, names, block, group_key(sorted(names)), None if coll is None else length,
            )
        layout.used = max(layout.used, step)
        return layout

    def _prune_layouts(self, step: int) -> None:
        """Drop the fused layouts no step used in ``step`` or the one before (a group the plan no
        longer makes, buckets now averaged in place), when the pools drop their buffers
        (:meth:`_pool`) and at every in-place bucket: a layout keeps views of a group's buffers,
        which would otherwise outlive the pool's hold on them."""
        if step > self._layouts_step:
            self._layouts_step = step
            self._fused_layouts = {k: v for k, v in self._fused_layouts.items() if v.used >= step - 1}

    def averages_in_place(self) -> bool:
        """Whether some bucket may be averaged in its own memory (:meth:`in_place`'s conditions
        that do not depend on the bucket, for the configured codec and collective)."""
        return self._in_place_capable(self.codec, self.collective)

    def _in_place_capable(self, codec: Codec, coll: Collective) -> bool:
        """Fusion on, no adaptive levels, a codec whose blocks are independent or a summed codec
        that takes a group by its parts laid back to back (PowerSGD, random-k: alignment 1, as
        DDP lays out a bucket) from a collective that carries them, a collective that releases
        its input before writing the average, and no error feedback or a plain residual.

        (A summed codec's group holds its input through the exchange on the default path, a
        copy this path does without: ResNet-50 at 2 ranks, PowerSGD +1.10 of the gradient's
        size over fp32 DDP where the default path adds +1.48. A gathered one by parts, top-k
        or SketchML, gives its copy back once encoded there already, and a bucket in flight as
        one group held more, +1.26 against +1.14 for top-k: they stay on the default path.)"""
        layout = codec.fusion_block() > 0 or (
            codec.parts_format and codec.summable and codec.fused_alignment() == 1 and coll.carries_parts)
        return (self.fusion and self.levels is None and layout and coll.releases_input
                and self.memory.name in IN_PLACE_MEMORIES)

    def in_place(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str],
                 compress: Sequence[bool]) -> bool:
        """Whether :meth:`bucket_stages` can average this bucket in its own memory.

        It needs the gradients to be the bucket (DDP's views, back to back), one codec and one
        collective for every compressed gradient, a codec whose blocks are independent
        (``fusion_block() > 0``) or a summed one that takes the bucket by its parts (see
        :meth:`_in_place_capable`), a collective that releases its input before writing the
        average, and an error feedback that is a plain residual kept in fp32, as the bucket.
        """
        comp = [names[i] for i, c in enumerate(compress) if c]
        if not comp or not buffer.is_contiguous() or buffer.dtype not in FLOAT_DTYPES:
            return False
        codec, coll, mem = self.codec_for(comp[0]), self.collective_for(comp[0]), self.memory
        if not self._in_place_capable(codec, coll):
            return False
        if any(self.codec_for(n) is not codec or self.collective_for(n) is not coll for n in comp):
            return False
        if mem.stateful and buffer.dtype != torch.float32:
            return False
        span = contiguous_span(tensors)
        return span is not None and span.data_ptr() == buffer.data_ptr() and span.numel() == buffer.numel()

    def bucket_stages(
        self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor], names: Sequence[str], compress: Sequence[bool],
        step: int,
    ) -> Stages:
        """Average a DDP bucket in its own memory (:meth:`in_place` says when): the lean path.

        Per step and bucket, over the compressed gradients' memory: the error-feedback residual
        is added in place (1 pass); the codec encodes the bucket as it lies (2; its own min/max
        or norm carries the non-finite flag); once every rank's flag is known, this rank's own
        payloads are decoded into the residual, which then becomes input minus decoded (3, and
        a subtraction); the average is decoded straight into the bucket (4). The uncompressed
        gradients of the bucket (small or 1-D ones) are copied out first, summed exactly in
        one plain all-reduce beside the compressed exchange and written back at the end; their
        places in the bucket are encoded as zeros. Blocks of the codec run across gradient
        boundaries, as in CGX's fused buffers; no copy of the bucket is kept from step to step,
        only the residual (with error feedback) and the collective's payload buffers. The number
        of operations does not grow with the number of gradients (:mod:`gradzip.sync.places`),
        and on an accelerator nothing waits for the device (:func:`settle_residual`).

        A codec that takes a group by its parts (PowerSGD) gets the bucket's members in DDP's
        order, each by its shape; a gradient not to be compressed is a 1-D part of its own,
        which PowerSGD sends as it is with its factors (no exchange of its own, no copy out),
        and other codecs get its place zeroed, as above. Carried so, they share the bucket's
        non-finite flag: a NaN or ±inf in any gradient of the bucket makes its whole average
        NaN on every rank (residuals kept), where a separate sum spreads one through the
        uncompressed gradients alone. Warm starts and residuals stay keyed by name, as on the
        default path.
        """
        started = time.perf_counter()
        self._prune_layouts(step)  # (it may lend nothing from the pools)
        comp = [i for i, c in enumerate(compress) if c]
        plain = [i for i, c in enumerate(compress) if not c]
        codec, coll, mem = self.codec_for(names[comp[0]]), self.collective_for(names[comp[0]]), self.memory
        span = buffer.view(-1)
        base = span.storage_offset()
        where = [(t.storage_offset() - base, t.numel()) for t in tensors]
        key = group_key(sorted(names[i] for i in comp))
        by_parts = codec.parts_format
        # the codec's parts: every gradient by its shape, an uncompressed one flat
        shapes = tuple((names[i], tensors[i].shape if compress[i] else torch.Size([tensors[i].numel()]))
                       for i in range(len(tensors))) if by_parts else None
        # the uncompressed ones go with the payload (not where error feedback scales the bucket
        # by its decay first: they are copied out then, as for other codecs)
        carried = by_parts and codec.flat_parts_as_they_are and (not mem.stateful or mem.gamma == 1.0)
        parts = []
        lent: List[torch.Tensor] = []
        try:
            places = None
            if plain and not carried:  # copied out before the bucket is touched: they are summed exactly
                places = self._places_of(span.device, [where[i] for i in plain])
                pool = self._pool(span.dtype, step)
                flat_plain = places.gather(span, pool.lend((places.numel,), span.device, lent))
                parts.append(self._reduce(flat_plain, f"uncompressed:{names[plain[0]]}", False, flat_plain, step))
            settle = None
            if mem.stateful:
                # the layout is part of the key: a bucket with the same members in another order
                # (DDP's rebuild) gets a buffer of its own, filled from the old one
                layout = stable_hash(*(f"{names[i]}:{where[i][0]}" for i in comp))
                members = [(names[i], where[i], tensors[i].shape) for i in comp]
                residual = self._group_residual(f"{key}@{layout:08x}", span, members)
                if mem.gamma != 1.0:
                    span.mul_(mem.gamma)
                span.add_(residual, alpha=mem.beta)
                settle = settle_residual(residual, scratch_for(span, self._pool(torch.float32, step), lent))
            if places is not None:
                places.fill_(span, 0)

            parts.append(coll.stages(codec, span, key, step, need_own=settle is not None, out=span, on_release=settle,
                                     parts=shapes))
            results = yield from lockstep(parts)
            res = results[-1]
            poison_if(span, res)
            if places is not None:
                avg_plain, plain_record = results[0]
                places.scatter_(span, avg_plain)
                self.metrics.record_group([(names[i], tensors[i].numel() * tensors[i].element_size()) for i in plain], **plain_record)
        finally:
            for buf in lent:  # each to the pool of its dtype
                self._flat_pools[buf.dtype].give_back([buf])
        # one encoding of the bucket (its uncompressed places included): independent of how
        # the collective cuts it, so the ratio does not move with the world size; a codec
        # by parts has its size from the shapes: what the collective measured
        if by_parts:
            wire = res.wire_bytes if res.payload_bytes is None else res.payload_bytes
        else:
            wire = codec.wire_bytes(span.numel(), span.dtype)
        factor = coll.sent_per_byte(self.world_size)
        if carried and plain:  # sent as they are inside the payload: counted as uncompressed, as on the default path
            raw = [(names[i], tensors[i].numel() * tensors[i].element_size()) for i in plain]
            plain_bytes = sum(n for _, n in raw)
            wire -= plain_bytes
            self.metrics.record_group(raw, wire=plain_bytes, encode_s=0.0, decode_s=0.0, compressed=False,
                                      sent=factor * plain_bytes, codec=self._plain_codec.name)
        record = record_of(res, wire, factor, True, codec)
        self.metrics.record_group([(names[i], tensors[i].numel() * tensors[i].element_size()) for i in comp], **record)
        self.metrics.record_group_time(key, time.perf_counter() - started)
        return list(tensors)

    def _pool(self, dtype: torch.dtype, step: int) -> BufferPool:
        """The buffers of ``dtype`` lent to this step's exchanges (kept from step to step); the
        fused layouts no longer used go with the buffers no longer lent."""
        pool = self._flat_pools.setdefault(dtype, BufferPool(dtype))
        pool.new_step(step)
        self._prune_layouts(step)
        return pool

    def _places_of(self, device: torch.device, where: Sequence[Tuple[int, int]]) -> Places:
        """The :class:`Places` ``where`` in a flat buffer on ``device`` (a bucket's uncompressed
        gradients, a group's padding), made once per layout."""
        key = (str(device), tuple(where))
        places = self._places.get(key)
        if places is None:
            if len(self._places) >= 256:  # layouts of buckets DDP no longer uses
                self._places.clear()
            places = self._places[key] = Places(where, device)
        return places

    def _group_residual(self, key: str, span: torch.Tensor, members) -> torch.Tensor:
        """One fp32 residual as long as the group's buffer, ``members``' parts (name, (start,
        numel), shape) registered as the memory's per-name residuals (views), so checkpoints
        stay keyed by name. A name whose residual lies elsewhere (a checkpoint, an earlier
        layout) is copied in; one without a residual starts at zero. A buffer no name points
        into any more is dropped."""
        mem = self.memory
        buf = self._group_residuals.get(key)
        if buf is None or buf.numel() != span.numel() or buf.device != span.device:
            buf = self._group_residuals[key] = torch.zeros(span.numel(), dtype=torch.float32, device=span.device)
        base, size = buf.data_ptr(), buf.element_size()
        for name, (start, n), shape in members:
            cur = mem.residuals.get(name)
            if cur is not None and cur.data_ptr() == base + start * size and cur.shape == shape:
                continue  # registered at an earlier step (checked without making a view: no work per gradient)
            view = buf[start : start + n].view(shape)
            if cur is None or cur.numel() != n:
                view.zero_()
            else:
                view.copy_(cur.reshape(shape))
            mem.residuals[name] = view
            old = self._residual_key.get(name)
            self._residual_key[name] = key
            if old is not None and old != key and old not in self._residual_key.values():
                self._group_residuals.pop(old, None)
        return buf


def contiguous_span(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """One flat view over ``tensors`` when they lie back to back, in order, in one storage (the
    gradients of a DDP bucket are views of its buffer); None otherwise."""
    first = tensors[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for t in tensors:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.device == first.device):
            return None
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
        offset += t.numel()
    n = offset - first.storage_offset()
    return first.new_empty(0).set_(storage, first.storage_offset(), (n,))


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, where ``dsts`` hold one dtype and ``srcs`` one dtype
    (views of one buffer, the gradients of one group or one plain sum): one multi-tensor copy
    where the two dtypes are the same, else a copy each (the CUDA fast path of
    ``torch._foreach_copy_`` takes its kernel from the first destination's dtype, and before
    PyTorch 2.11 did not check that the sources match). Only the first of each is read: a
    check of every tensor costs the worker more host time than the copy on an accelerator."""
    if not dsts:
        return
    if dsts[0].dtype == srcs[0].dtype:
        torch._foreach_copy_(list(dsts), list(srcs))
        return
    for dst, src in zip(dsts, srcs):
        dst.copy_(src)
