"""``gradzip run``: ``torchrun`` that compresses every DDP model of an unedited training script.

``gradzip run --nproc-per-node 4 --codec maxmin --bits 4 train.py --lr 0.1`` takes every
``torchrun`` option (it parses them with ``torch.distributed.run``'s own parser and launches with
its ``run``), plus gradzip's: ``--codec``, ``--bits``, ``--memory``, ``--collective`` and
``--option key=value`` become ``GRADZIP_*`` variables of the workers (over any already set), so
:class:`gradzip.Config` reads them exactly as it reads a user's own. Each worker runs the script
through :mod:`gradzip.tools.run_worker`, which registers gradzip on every ``DistributedDataParallel``
the script builds and has rank 0 print a one-line summary at exit.
"""
from __future__ import annotations

import argparse
import os
import re
import site
import sys
from typing import Dict, List, Optional, Sequence

WORKER = "gradzip.tools.run_worker"


def _key_value(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key.strip(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with gradzip's options added (so every torchrun option keeps working)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "gradzip run"
    parser.description = (
        "Launch like torchrun; every DistributedDataParallel model the script builds gets gradzip "
        "registered (settings from the options below, else from GRADZIP_* variables)."
    )
    g = parser.add_argument_group("gradzip")
    g.add_argument("--codec", help="codec name, e.g. maxmin, qsgd, topk, powersgd (GRADZIP_CODEC)")
    g.add_argument("--bits", type=int, help="bits per value for quantizing codecs (GRADZIP_BITS)")
    g.add_argument("--memory", help="error feedback: none, residual, ... (GRADZIP_MEMORY)")
    g.add_argument("--collective", help="exchange: allreduce, allgather, sra, ps, ... (GRADZIP_COLLECTIVE)")
    g.add_argument(
        "--option", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
        help="any other setting or codec option, e.g. --option ratio=0.01 (GRADZIP_KEY=VALUE); repeatable",
    )
    g.add_argument("--no-summary", action="store_true", help="rank 0 prints no summary line at exit")
    return parser


def worker_environment(args: argparse.Namespace, environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The launcher's environment plus the ``GRADZIP_*`` variables that ``args`` set.

    Command-line settings win over variables already set: they are the more specific request.
    """
    env = dict(os.environ if environ is None else environ)
    settings = {"codec": args.codec, "bits": args.bits, "memory": args.memory, "collective": args.collective}
    settings.update(dict(args.option))
    for key, value in settings.items():
        if value is not None:
            env["GRADZIP_" + key.upper().replace("-", "_")] = str(value)
    # the workers must import this same gradzip; a site directory is on their path already
    # (putting one on PYTHONPATH would move it ahead of the standard library)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sites = {os.path.abspath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    if root not in sites:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return env


def check_settings(env: Dict[str, str]) -> None:
    """Build the codec, memory and collective the workers will build, so a typo fails here
    and not on every rank."""
    from ..config import Config
    from ..frontends.ddp import check_codec_name
    from ..sync.engine import check_settings as check

    cfg = Config().with_env(env)
    try:
        check_codec_name(cfg)
    except ValueError as exc:
        raise ValueError(f"{exc} (a codec that the script registers itself is not known here: name it in the "
                         "script's register() call instead)") from exc
    cfg = cfg.resolved()
    try:
        check(cfg.codec, cfg.options, cfg.memory, cfg.collective, cfg.collective_options)
    except ValueError as exc:  # the variables it came from, set by this command's options or already there
        said = str(exc)
        # the settings the message names (an option's own name, or the codec's), else all of them
        named = [v for k, v in cfg.sources.items() if re.search(rf"\b{re.escape(k.split('.')[-1])}\b", said)]
        named = named or list(cfg.sources.values())
        if not named:
            raise
        raise ValueError(f"{exc} (from {', '.join(sorted(set(named)))})") from exc


def worker_command(args: argparse.Namespace) -> List[str]:
    """Turn ``script args`` into ``-m gradzip.tools.run_worker [--no-summary] (--module M | script) args``."""
    if args.no_python:
        raise ValueError("gradzip run starts the script with Python itself: --no-python cannot be used")
    head = ["--no-summary"] if args.no_summary else []
    head += ["--module", args.training_script] if args.module else ["--", args.training_script]
    return head + list(args.training_script_args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        script_args = worker_command(args)
        env = worker_environment(args)
        check_settings(env)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args.training_script, args.training_script_args = WORKER, script_args
    args.module, args.run_path = True, False  # the worker module runs the script (or module) itself
    os.environ.update(env)  # torchrun's workers inherit this process's environment
    try:
        run(args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0
