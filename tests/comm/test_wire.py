"""The wire format of one message (payload tensors and the non-finite flag) and the SRA's segments."""
from __future__ import annotations

import pytest
import torch

from gradzip.codecs.base import Payload
from gradzip.comm.base import any_flag, from_bytes, payload_views, sent_as, spec_bytes, spec_of, to_bytes
from gradzip import codec, collectives
from gradzip.comm.sra import CPU_SEGMENT, segment_values, whole_segment
from gradzip.config import parse_value
from gradzip.kernels import native


def _payload():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8), torch.randn(5, generator=g)]


@pytest.mark.parametrize("flag", [False, True])
def test_a_message_round_trips_over_a_dirty_buffer(flag):
    tensors = _payload()
    spec = spec_of(tensors)
    out = torch.full((spec_bytes(spec),), 0xAB, dtype=torch.uint8)  # a pool buffer holds old bytes
    to_bytes(tensors, torch.tensor(flag), out=out)
    views, got = from_bytes(out, spec)
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    assert all(torch.equal(v, t) for v, t in zip(payload_views(out, spec), tensors))
    assert bool(got) is flag
    assert torch.equal(to_bytes(tensors, torch.tensor(flag)), out)  # the same bytes as a fresh buffer


def test_a_payload_sent_from_its_message_is_views_of_it_and_the_same_bytes():
    """A payload whose form is known only once encoded is copied into its message, which then
    stands for it (the encoded tensors are not kept while the message is on the wire)."""
    tensors = _payload()
    spec = spec_of(tensors)
    out = torch.full((spec_bytes(spec),), 0xAB, dtype=torch.uint8)
    sent = sent_as(Payload(tensors, "ctx"), out, spec)
    assert sent.ctx == "ctx" and all(torch.equal(v, t) for v, t in zip(sent.tensors, tensors))
    assert all(v.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for v in sent.tensors)
    to_bytes(sent.tensors, torch.tensor(True), out=out)  # nothing left to copy: the flag alone
    assert torch.equal(out, to_bytes(tensors, torch.tensor(True)))


def test_a_payload_is_sent_from_its_message_byte_for_byte():
    """Bytes of a bool tensor that are not 0 or 1 (a codec's own packing) go on the wire as
    they are, as ``to_bytes`` sends them."""
    tensors = [torch.tensor([2, 255, 0, 1], dtype=torch.uint8).view(torch.bool), torch.randn(3)]
    spec = spec_of(tensors)
    out = torch.zeros(spec_bytes(spec), dtype=torch.uint8)
    sent = sent_as(Payload(tensors, None), out, spec)
    assert torch.equal(to_bytes(sent.tensors, torch.tensor(False), out=out), to_bytes(tensors, torch.tensor(False)))
    assert out[:4].tolist() == [2, 255, 0, 1]


def test_the_flags_of_several_ranks_are_ored_in_one_operation():
    tensors = _payload()
    spec = spec_of(tensors)
    rows = torch.stack([to_bytes(tensors, torch.tensor(False)) for _ in range(4)])
    assert any_flag(rows, spec).dtype == torch.bool and not any_flag(rows, spec)
    to_bytes(tensors, torch.tensor(True), out=rows[2])
    assert any_flag(rows, spec)


def test_segments_pipeline_on_the_cpu_and_stay_whole_elsewhere_unless_given():
    big = CPU_SEGMENT * 3
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert segment_values(None, big, cpu) == CPU_SEGMENT
    assert segment_values(None, big, meta) == big
    assert segment_values(100, big, meta) == segment_values(100, 10, cpu) == 100
    assert segment_values(None, 0, meta) == 1
    # at W ranks: W chunks of whole blocks a segment, or the whole input where one segment holds it
    assert whole_segment(None, big, torch.device("cpu"), 3, 512) == CPU_SEGMENT // 1536 * 1536
    assert whole_segment(None, big + 7, torch.device("meta"), 3, 512) == big + 7
    assert whole_segment(3000, 2999, torch.device("cpu"), 3, 64) == 2999
    assert whole_segment(3000, 3001, torch.device("cpu"), 3, 64) == 2880


def test_one_rank_quantises_twice_through_its_own_buffers():
    """One rank sends and gathers in one buffer: the average is the round trip of the round trip
    (each chunk is re-encoded after averaging), its own share is the first round trip."""
    mm = codec("maxmin", bits=4, mode="nearest", bucket_size=64)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    x[17] = 40.0  # one bucket with a wide range
    res = collectives.get("sra")(None).run(mm, x, "w", 0, need_own=True)
    once = mm.decode(mm.encode(x, "w", 0))
    assert torch.equal(res.own, once)
    assert torch.equal(res.avg, mm.decode(mm.encode(once, "w#0", 0)))
    assert not res.nonfinite
    x[3] = float("inf")
    assert collectives.get("sra")(None).run(mm, x, "w", 0, need_own=False).nonfinite


@pytest.mark.parametrize("spec", [("maxmin", {"bits": 2}), ("qsgd", {"bits": 3})])
def test_one_rank_keeps_its_own_payloads_while_it_re_encodes_into_its_buffers(spec):
    """The own share is the first round trip, though the second round's bytes are written into
    the one buffer. For QSGD they differ (another norm, the next draws), so an own share read
    from the re-encoded bytes would differ; max-min re-encodes its decoded values exactly."""
    name, opts = spec
    x = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    res = collectives.get("sra")(None).run(codec(name, seed=3, bucket_size=64, **opts), x, "w", 0, need_own=True)
    fresh = codec(name, seed=3, bucket_size=64, **opts)
    once = fresh.decode(fresh.encode(x, "w#0", 0))  # the first round's draws
    assert torch.equal(res.own, once)
    assert torch.equal(res.avg, once) == (name == "maxmin")


@pytest.mark.skipif(native.available() is not None, reason="the torch kernels write a payload, then copy it")
@pytest.mark.parametrize("name,coll,rounds", [
    (name, coll, rounds) for name in ("maxmin", "qsgd", "fp8", "mxfp8", "mxfp4", "signsgd")
    for coll, rounds in (("sra", 2), ("allgather", 1)) if coll in codec(name).collectives
])
def test_fixed_form_payloads_are_encoded_straight_into_the_message_buffers(name, coll, rounds):
    """Max-min, QSGD, FP8, MX and signSGD: only each message's flag slot is copied into a byte buffer
    (one per round; one rank's all-gather decodes its message where it was written): the
    payloads (codes, statistics, scales) are written where they are sent from
    (``Codec.payload_spec``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.copy_ and args[0].dtype == torch.uint8:
                copies.append(args[1].numel())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4096)
    c = codec(name, **({"block_size": 64} if name.startswith(("fp8", "mx")) else {} if name == "signsgd" else {"bucket_size": 64}))
    with Spy():
        res = collectives.get(coll)(None).run(c, x, "w", 0, need_own=True)
    assert copies == [8] * rounds, copies
    assert res.own is not None and torch.isfinite(res.avg).all()


def test_an_option_that_defaults_to_none_can_be_set_to_none_from_the_environment():
    assert parse_value("none") is None and parse_value("None") is None and parse_value("4194304") == 4194304
