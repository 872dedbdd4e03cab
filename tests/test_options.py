"""One way to declare and check options: codecs, memories and collectives alike."""
from __future__ import annotations

import pytest

import gradzip
from gradzip import collectives, memory
from gradzip.options import Configurable, Option, float_in, int_in, optional


def test_every_memory_and_collective_declares_its_options_and_refuses_unknown_ones():
    for kind, names, make in (
        ("memory", memory.names(), lambda n, **o: memory.memory(n, **o)),
        ("collective", collectives.names(), lambda n, **o: collectives.get(n)(None, **o)),
        ("codec", gradzip.codecs.names(), lambda n, **o: gradzip.codec(n, **o)),
    ):
        for name in names:
            obj = make(name)
            assert isinstance(obj, Configurable) and obj.kind == kind
            assert obj.config() == {k: getattr(obj, k) for k in obj.options}
            with pytest.raises(ValueError, match=rf"{kind} '{name}': unknown option\(s\) nonsense; valid options: "):
                make(name, nonsense=1)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: memory.memory("residual", beta="x"), "memory 'residual': beta must be a finite number >= 0, got 'x'"),
        (lambda: memory.memory("residual", gamma=float("nan")), "memory 'residual': gamma must be a finite number >= 0"),
        (lambda: memory.memory("residual", beta=-1.0), "memory 'residual': beta must be a finite number >= 0"),
        (lambda: memory.memory("residual", gamma=float("inf")), "memory 'residual': gamma must be a finite number >= 0"),
        (lambda: gradzip.codec("threshold", threshold=float("inf")),
         "codec 'threshold': threshold must be a finite non-negative float"),
        (lambda: memory.memory("dgc", momentum=1.0), r"memory 'dgc': momentum must be a float in \[0, 1\), got 1.0"),
        (lambda: memory.memory("dgc", clip_norm=0), "memory 'dgc': clip_norm must be None or a positive number"),
        (lambda: memory.memory("efsign", beta=0.5), "memory 'efsign': unknown option.*valid options: \\(none\\)"),
        (lambda: collectives.get("ps")(None, partitions=0), "collective 'ps': partitions must be a positive integer or None"),
        (lambda: collectives.get("ps")(None, min_partition=2.0), "collective 'ps': min_partition must be a positive integer"),
        (lambda: collectives.get("sra")(None, segment=True), "collective 'sra': segment must be a positive integer"),
        (lambda: gradzip.Communicator("maxmin", collective="sra", collective_options={"segments": 4}),
         "collective 'sra': unknown option\\(s\\) segments; valid options: segment$"),
        # an option of another class of the kind: the message says whose
        (lambda: gradzip.Communicator("maxmin", collective="sra", collective_options={"partitions": 2}),
         "collective 'sra': unknown option\\(s\\) partitions; valid options: segment; partitions is an option of "
         "collective 'ps'$"),
        (lambda: gradzip.codec("maxmin", ratio=0.1, bogus=1), "codec 'maxmin': unknown option\\(s\\) bogus, ratio; .*"
         "ratio is an option of codec 'dgc', 'graddrop', 'randomk', 'sketchml', 'topk'$"),
    ],
)
def test_bad_values_name_the_option_and_what_it_must_be(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_options_in_force_are_what_ranks_compare():
    comm = gradzip.Communicator(
        "maxmin", bits=2, memory="dgc", memory_options={"momentum": 0.5}, collective="ps",
        collective_options={"partitions": 3},
    )
    settings = comm.settings()
    assert settings["codec.bits"] == 2 and settings["memory.momentum"] == 0.5 and settings["memory.clip_norm"] is None
    assert settings["collective.partitions"] == 3 and settings["collective.min_partition"] == 4096
    comm.close()


def test_a_class_of_its_own_declares_options_the_same_way():
    class Thing(Configurable):
        kind, name = "thing", "demo"
        options = {
            "size": Option(8, int_in(1, 64), "an integer in 1..64"),
            "rate": Option(None, optional(float_in(0.0, 1.0)), "None or a float in [0, 1]"),
        }

        def __init__(self, **opts):
            self.set_options(opts)

    assert Thing().config() == {"size": 8, "rate": None} and Thing(rate=0.5).rate == 0.5
    with pytest.raises(ValueError, match="thing 'demo': size must be an integer in 1..64, got 65"):
        Thing(size=65)
