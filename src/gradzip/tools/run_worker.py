"""The worker side of ``gradzip run``: run a script as ``python`` would, with gradzip on every DDP.

``python -m gradzip.tools.run_worker [--no-summary] (--module NAME | -- SCRIPT) ARGS...`` patches
:class:`~torch.nn.parallel.DistributedDataParallel` and then runs the script as ``__main__``.
Registration waits for a model's first forward, not its constructor: a script that registers its
own communication hook after wrapping (DDP allows only one) keeps it, with a warning, and
gradzip stays off that model. Settings come from ``GRADZIP_*`` (which ``gradzip run`` sets from
its options). At exit rank 0 prints one summary line of what was compressed.
"""
from __future__ import annotations

import os
import runpy
import sys
import warnings
from typing import Any, List, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ..frontends.ddp import GradzipState, register

SUMMARY_PREFIX = "gradzip run:"
states: List[GradzipState] = []  # every state registered in this process, in order
skipped = 0  # models left alone because the script gave them a hook of its own
_installed = False


def _has_own_hook(model: DistributedDataParallel) -> bool:
    return bool(model.__dict__.get("_gradzip_user_hook") or getattr(model, "_comm_hooks", None))


def _attach(model: DistributedDataParallel) -> None:
    """Register gradzip on ``model`` once (called on every rank at its first forward)."""
    global skipped
    model.__dict__["_gradzip_run_seen"] = True
    if _has_own_hook(model):
        skipped += 1
        warnings.warn(
            "gradzip run: this DistributedDataParallel model already has a communication hook; "
            "gradzip leaves it as it is and does not compress this model", stacklevel=3,
        )
        return
    state = register(model)
    model.__dict__["_gradzip_state"] = state
    states.append(state)


def install() -> None:
    """Patch DDP so every model gets gradzip at its first forward (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    forward = DistributedDataParallel.forward
    register_comm_hook = DistributedDataParallel.register_comm_hook
    register_builtin = DistributedDataParallel._register_builtin_comm_hook

    # registering makes process groups and runs collectives: under torch.compile(DDP(model)) the
    # forward is traced, so the check and the registration run eagerly (a graph break before the
    # forward's first operation), each time, not as whatever the trace saw first
    @torch.compiler.disable
    def attach_once(model: DistributedDataParallel) -> None:
        if "_gradzip_run_seen" not in model.__dict__:
            _attach(model)

    def patched_forward(self: DistributedDataParallel, *inputs: Any, **kwargs: Any) -> Any:
        attach_once(self)
        return forward(self, *inputs, **kwargs)

    def own_hook(original):
        def wrapper(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
            if "_gradzip_state" in self.__dict__:
                raise RuntimeError(
                    "gradzip run already registered gradzip's communication hook on this model (at its first "
                    "forward) and DDP takes only one: register yours before the first forward, or launch "
                    "with torchrun instead of gradzip run"
                )
            self.__dict__["_gradzip_user_hook"] = True
            return original(self, *args, **kwargs)

        wrapper.__doc__, wrapper.__name__ = original.__doc__, original.__name__
        return wrapper

    patched_forward.__doc__ = forward.__doc__
    DistributedDataParallel.forward = patched_forward
    DistributedDataParallel.register_comm_hook = own_hook(register_comm_hook)
    DistributedDataParallel._register_builtin_comm_hook = own_hook(register_builtin)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def summary() -> str:
    """One line: codec, compression ratio, bytes sent, encode/decode time (this rank's counts)."""
    if not states:
        extra = f" ({skipped} had a hook of their own)" if skipped else ""
        return f"{SUMMARY_PREFIX} no DistributedDataParallel model was compressed{extra}"
    stats = [s.stats() for s in states]
    raw = sum(s["raw_bytes"] for s in stats)
    wire = sum(s["wire_bytes"] for s in stats)
    ratio = raw / wire if wire else float("inf") if raw else 1.0
    codecs = []
    for state, st in zip(states, stats):
        options = ",".join(f"{k}={v}" for k, v in sorted(state.config.options.items()))
        desc = f"{st['codec']}({options})" if options else st["codec"]
        codecs.append(desc if st["memory"] in (None, "none") else f"{desc}+{st['memory']}")
    models = f"{len(states)} DDP model" + ("s" if len(states) > 1 else "")
    sent = sum(s.get("sent_bytes", s["wire_bytes"]) for s in stats)  # older metrics: the payload bytes
    steps = max((s.get("steps", s.get("calls", 0)) for s in stats), default=0)
    exposed = [s[k] for s in stats for k in ("exposed_comm_s", "exposed_s") if k in s]
    timing = (
        f"exposed communication {sum(exposed):.3f} s" if exposed
        else f"encode {sum(s['encode_s'] for s in stats):.3f} s, decode {sum(s['decode_s'] for s in stats):.3f} s"
    )
    return (
        f"{SUMMARY_PREFIX} {', '.join(dict.fromkeys(codecs))} on {models}: ratio {ratio:.2f}x "
        f"({_mb(wire)} payload for {_mb(raw)} of gradients), {_mb(sent)} sent, {steps} steps; {timing} (rank 0)"
    )


def _run(module: Optional[str], script: Optional[str], args: Sequence[str]) -> None:
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's path in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` has it
        runpy.run_path(script, run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    show = True
    if argv[:1] == ["--no-summary"]:
        show, argv = False, argv[1:]
    if len(argv) < 2 or argv[0] not in ("--module", "--"):
        raise SystemExit("usage: python -m gradzip.tools.run_worker [--no-summary] (--module NAME | -- SCRIPT) [ARGS...]")
    module, script = (argv[1], None) if argv[0] == "--module" else (None, argv[1])
    install()
    code: Any = None
    try:
        _run(module, script, argv[2:])
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        code = exc.code
    if show and os.environ.get("RANK", "0") == "0":
        print(summary(), flush=True)
    if code is not None:
        sys.exit(code)


if __name__ == "__main__":
    main()
