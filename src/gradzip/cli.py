"""The ``gradzip`` command: ``gradzip demo``, ``gradzip bench allreduce`` and ``gradzip bench codecs``,
``gradzip run`` (torchrun with gradzip on every DDP model) and ``gradzip doctor``.

Heavy modules (the demo, the benchmark, rich) are imported by the subcommand that needs them, so
``gradzip --help`` stays quick and a missing optional extra only breaks the command that uses it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence


def _config_list(text: str) -> List[str]:
    """``"fp32,maxmin4"`` → ``["fp32", "maxmin4"]``, each checked against the demo's configs."""
    from .demo import CONFIGS

    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown config(s) {', '.join(bad) or '(none given)'}; choose from: {', '.join(CONFIGS)}"
        )
    return names


def _codec_list(text: str) -> List[str]:
    """Codec specs ``name[:key=value...]`` separated by commas, each checked by building it."""
    from .bench.micro import parse_spec
    from .codecs import codec

    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        try:
            name, opts = parse_spec(spec)
            codec(name, **{k: v for k, v in opts.items() if k not in ("memory", "collective")})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


def _size_mb(text: str) -> float:
    """One tensor size in MiB: a positive number that holds at least one fp32 value."""
    from .bench.micro import check_sizes

    try:
        return check_sizes([float(text)])[0]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size must be a positive number of MiB, got {text!r}") from None


def _size_list(text: str) -> List[float]:
    """``"1,4,16"`` → ``[1.0, 4.0, 16.0]`` (MiB), each checked; duplicates dropped."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("expected comma-separated sizes in MiB, e.g. 1,4,16,64,256")
    return list(dict.fromkeys(_size_mb(p) for p in parts))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_CONFIGS, DEFAULTS

    parser = argparse.ArgumentParser(prog="gradzip", description="Gradient compression for data-parallel PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a digits MLP on local gloo ranks with several codecs and compare")
    demo.add_argument("--workers", type=_positive, default=DEFAULTS["workers"], help="local ranks (default %(default)s)")
    demo.add_argument("--epochs", type=_positive, default=DEFAULTS["epochs"], help="default %(default)s")
    demo.add_argument("--batch-size", type=_positive, default=DEFAULTS["batch_size"], help="global batch (default %(default)s)")
    demo.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="SGD learning rate (default %(default)s)")
    demo.add_argument("--momentum", type=float, default=DEFAULTS["momentum"], help="default %(default)s")
    demo.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="model, split and shuffle seed")
    demo.add_argument("--width", type=_positive, default=DEFAULTS["width"], help="hidden width of the MLP (default %(default)s)")
    demo.add_argument(
        "--rate", default=None,
        help="train on an emulated cluster with links of this rate (e.g. 100mbit, 1gbit; needs root and iproute2)",
    )
    demo.add_argument(
        "--configs", type=_config_list, default=DEFAULT_CONFIGS,
        help=f"comma-separated configs (default {','.join(DEFAULT_CONFIGS)})",
    )
    demo.add_argument("--out", default="demo-results", help="directory for results.json and demo.png (default %(default)s)")

    run = sub.add_parser(
        "run", add_help=False, help="launch like torchrun; every DDP model the script builds is compressed",
        description="gradzip run [torchrun options] [--codec C --bits B --option k=v] script.py [script args]",
    )
    run.add_argument("args", nargs=argparse.REMAINDER, help="torchrun options, gradzip options, script and its arguments")
    sub.add_parser("doctor", help="what gradzip will use here: torch build, backends, kernels, compiler, Triton, cluster")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    ar = bench_sub.add_parser("allreduce", help="time one all-reduce of a large fp32 tensor, plain vs compressed")
    ar.add_argument("--workers", type=_positive, default=4, help="local ranks (default %(default)s)")
    sizes = ar.add_mutually_exclusive_group()
    sizes.add_argument("--size-mb", type=_size_mb, default=None, help="tensor size in MiB (default 100)")
    sizes.add_argument(
        "--sizes", type=_size_list, default=None,
        help="a sweep of sizes in MiB, e.g. 1,4,16,64,256, all in one run of the ranks (instead of --size-mb)",
    )
    ar.add_argument("--repeats", type=_positive, default=5, help="timed runs after one warm-up (default %(default)s)")
    ar.add_argument(
        "--codecs", type=_codec_list, default=[],
        help="extra codecs besides maxmin:bits=4, e.g. fp16,maxmin:bits=2,topk:ratio=0.01",
    )
    ar.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    ar.add_argument(
        "--plot", dest="plot_path",
        help="draw time and bus bandwidth against size to this PNG (default with --json: next to it, same name)",
    )
    ar.add_argument(
        "--rate", default=None,
        help="emulate a cluster with links of this rate (e.g. 100mbit, 1gbit, 10gbit; needs root and iproute2); "
        "default: plain loopback",
    )
    cb = bench_sub.add_parser("codecs", help="bits per element and encode+decode speed of each codec (one process)")
    cb.add_argument("--codecs", type=_codec_list, default=[], help="codec specs (default: every registered codec)")
    cb.add_argument("--numel", type=_positive, default=1 << 20, help="elements (default %(default)s)")
    cb.add_argument("--repeats", type=_positive, default=5, help="timed runs after one warm-up (default %(default)s)")
    cb.add_argument("--threads", type=_positive, default=1, help="torch threads (default %(default)s)")
    cb.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    cb.add_argument(
        "--plot", dest="plot_path",
        help="draw GB/s per codec against memory-copy speed to this PNG (default with --json: next to it, same name)",
    )
    return parser


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)  # pipes and logs get the whole table


def _plot(draw: Callable[[Dict[str, Any], str], None], report: Dict[str, Any], args: argparse.Namespace, console: Any) -> None:
    """Draw ``report`` to ``--plot``, or next to ``--json`` when only that was given.

    A missing matplotlib fails an explicit ``--plot`` and only skips the implicit one.
    """
    path = args.plot_path
    if path is None and args.json_path:
        path = os.path.splitext(args.json_path)[0] + ".png"
    if path is None:
        return
    try:
        draw(report, path)
    except ImportError as exc:
        if args.plot_path:
            raise
        console.print(f"no plot ({exc}); install the 'bench' extra for one")
        return
    console.print(f"plot: {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's options and the script's own: parsed by gradzip.run alone
        from . import run

        return run.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from . import doctor

        return doctor.main()
    if args.command == "demo":
        from . import demo

        report = demo.run_demo(
            args.configs, out=args.out, workers=args.workers, epochs=args.epochs,
            batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, seed=args.seed,
            width=args.width, rate=args.rate,
        )
        console = _console()
        console.print(demo.table(report))
        console.print(f"total wall time {report['total_wall_s']:.1f} s; results and plot in {args.out}/")
        return 0 if all(r.get("identical", True) for r in report["results"]) else 1  # failed baselines are rows
    if args.command == "bench" and args.bench == "allreduce":
        from .bench import micro, plots

        report = micro.run_allreduce(
            args.workers, args.size_mb, args.repeats, args.codecs, args.json_path, args.rate, sizes_mb=args.sizes,
        )
        console = _console()
        console.print(micro.table(report))
        _plot(plots.allreduce, report, args, console)
        return 0
    if args.command == "bench" and args.bench == "codecs":
        from .bench import codecs as codec_bench
        from .bench import plots

        report = codec_bench.run(args.codecs, args.numel, args.repeats, args.threads, args.json_path)
        console = _console()
        console.print(codec_bench.table(report))
        _plot(plots.codecs, report, args, console)
        return 0
    raise AssertionError(args)  # argparse rejects everything else


if __name__ == "__main__":
    sys.exit(main())
