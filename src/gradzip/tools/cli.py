"""The ``gradzip`` command: ``gradzip demo``, ``gradzip bench allreduce``, ``codecs``, ``models``, ``memory`` and ``accuracy``,
``gradzip run`` (torchrun with gradzip on every DDP model) and ``gradzip doctor``.

Heavy modules (the demo, the benchmark, rich) are imported by the subcommand that needs them, so
``gradzip --help`` stays quick and a missing optional extra only breaks the command that uses it.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence


def _names(text: str, valid: Sequence[str], what: str) -> List[str]:
    """``"a,b"`` → ``["a", "b"]`` (repeats dropped), each checked against ``valid``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what}(s) {', '.join(bad) or '(none given)'}; choose from: {', '.join(valid)}"
        )
    return list(dict.fromkeys(names))


def _config_list(text: str) -> List[str]:
    """``"fp32,maxmin4"`` → ``["fp32", "maxmin4"]``, each checked against the demo's configs."""
    from .demo import CONFIGS

    return _names(text, list(CONFIGS), "config")


def _checked(text: str, check: Callable[[str], Any]) -> List[str]:
    """The comma-separated items of ``text``; ``check`` raises ``ValueError`` for a bad one."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    for item in items:
        try:
            check(item)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return items


def _codec_list(text: str) -> List[str]:
    """Codec specs ``name[:key=value...]`` separated by commas, each checked by building it."""
    from ..bench.micro import check_spec

    return _checked(text, check_spec)


def _size_mb(text: str) -> float:
    """One tensor size in MiB: a positive number that holds at least one fp32 value."""
    from ..bench.micro import check_sizes

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


def _bench_device(text: str) -> str:
    """``cpu`` or ``cuda[:index]``, one this machine has."""
    from ..bench.codecs import check_device

    try:
        return str(check_device(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench_report(what: str, run: Callable[[], Dict[str, Any]], table: Callable[[Dict[str, Any]], Any],
                  json_path: Optional[str]) -> int:
    """Run a benchmark and print its table; a bad setting found on the way ends the command with it."""
    try:
        report = run()
    except ValueError as exc:
        raise SystemExit(f"gradzip bench {what}: {exc}")
    console = _console()
    console.print(table(report))
    if json_path:
        console.print(f"results: {json_path}" + (f" ({report['wall_s']:.0f} s)" if "wall_s" in report else ""))
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _at_least_two(text: str) -> int:
    value = _positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (DDP rebuilds its buckets after the first), got {text!r}")
    return value


def _accuracy_tasks(text: str) -> List[str]:
    """``"digits,charlm"``, each checked against the accuracy benchmark's tasks."""
    from ..bench.accuracy import TASKS

    return _names(text, list(TASKS), "task")


def _accuracy_configs(text: str) -> List[str]:
    """Demo config names or codec specs separated by commas, each checked (``bench.accuracy.resolve``)
    against the front end that takes it; the chosen ``--frontend`` checks them again."""
    from ..bench.accuracy import resolve

    def check(config: str) -> None:
        try:
            resolve(config, "ddp")
        except ValueError:
            resolve(config, "fsdp")  # a config of FSDP2 alone (bf16-reduce, weight_bits)

    return list(dict.fromkeys(_checked(text, check)))


def _model_list(text: str) -> List[str]:
    """``"resnet50,gpt2"`` → ``["resnet50", "gpt2"]``, each checked against the benchmark's models."""
    from ..bench.models import MODELS

    return _names(text, list(MODELS), "model")


def _method_list(text: str) -> List[str]:
    """Demo config names or codec specs separated by commas, each checked (see ``bench.models.resolve``)."""
    from ..bench.models import resolve

    return _checked(text, resolve)


def _fsdp_methods(text: str) -> List[str]:
    """``fp32``, ``bf16-reduce`` or codec specs, separated by commas; a codec must exist and
    compress a sharded reduce-scatter, and ``weight_bits`` be 2..8 (checked before any rank starts)."""
    from ..bench.micro import check_options, parse_spec
    from ..codecs import names
    from ..comm.reducescatter import sharded_codecs
    from ..frontends.fsdp import weight_bits_problem

    out = [t.strip() for t in text.split(",") if t.strip()]
    for spec in out:
        if spec not in ("fp32", "bf16-reduce"):
            try:
                codec, opts = parse_spec(spec)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
            if codec not in names():
                raise argparse.ArgumentTypeError(
                    f"unknown method {spec!r}: fp32, bf16-reduce, or a codec spec ({', '.join(names())})"
                )
            problem = weight_bits_problem(opts.pop("weight_bits", None))
            if problem:
                raise argparse.ArgumentTypeError(f"{spec!r}: {problem}")
            try:
                check_options(codec, opts)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{spec!r}: {exc}") from None
            able = sharded_codecs()
            if codec not in able:
                raise argparse.ArgumentTypeError(
                    f"{spec!r}: {codec} cannot compress a sharded reduce-scatter; codecs that can: {', '.join(able)}"
                )
    if not out:
        raise argparse.ArgumentTypeError("no methods given")
    return out


def _link_rate(text: str) -> Optional[str]:
    """A link rate for the emulated cluster (``100mbit``, ``1gbit``), or None for ``loopback``."""
    from ..bench.cluster import parse_rate

    if text.strip().lower() in ("loopback", "none"):
        return None
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or loopback") from None
    return text.strip().lower()


def build_parser() -> argparse.ArgumentParser:
    from ..codecs import names as codec_names
    from .demo import COMMAND_DEFAULTS as DEFAULTS
    from .demo import CONFIGS, DEFAULT_CONFIGS

    parser = argparse.ArgumentParser(prog="gradzip", description="Gradient compression for data-parallel PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="train a digits MLP on local gloo ranks with several codecs and compare")
    demo.add_argument("--workers", type=_positive, default=DEFAULTS["workers"], help="local ranks (default %(default)s)")
    demo.add_argument(
        "--ranks-per-node", type=_positive, default=DEFAULTS["ranks_per_node"],
        help="ranks per emulated node (default %(default)s): with more than one, the workers form nodes that share "
        "a namespace and one shaped link, as on several machines, and gradzip exchanges hierarchically",
    )
    demo.add_argument("--epochs", type=_positive, default=DEFAULTS["epochs"], help="default %(default)s")
    demo.add_argument("--batch-size", type=_positive, default=DEFAULTS["batch_size"], help="global batch (default %(default)s)")
    demo.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="SGD learning rate (default %(default)s)")
    demo.add_argument("--momentum", type=float, default=DEFAULTS["momentum"], help="default %(default)s")
    demo.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="model, split and shuffle seed")
    demo.add_argument("--width", type=_positive, default=DEFAULTS["width"], help="hidden width of the MLP (default %(default)s)")
    demo.add_argument(
        "--rate", type=_link_rate, default=DEFAULTS["rate"],
        help="train on an emulated cluster with links of this rate (e.g. 100mbit, 1gbit; needs root and iproute2; "
        f"default %(default)s); 'loopback' for none. Without root or iproute2 the demo runs on loopback and "
        f"estimates each config's wire time at {DEFAULTS['rate']}",
    )
    demo.add_argument(
        "--configs", type=_config_list, default=DEFAULT_CONFIGS,
        help=f"comma-separated configs (default {','.join(DEFAULT_CONFIGS)}); all: {','.join(CONFIGS)}",
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
        "--rate", type=_link_rate, default=None,
        help="emulate a cluster with links of this rate (e.g. 100mbit, 1gbit, 10gbit; needs root and iproute2); "
        "default: plain loopback ('loopback')",
    )
    cb = bench_sub.add_parser("codecs", help="bits per element and encode+decode speed of each codec (one process)")
    cb.add_argument(
        "--codecs", type=_codec_list, default=[],
        help="comma-separated codec specs name[:key=value...], e.g. maxmin:bits=2,topk:ratio=0.01,fp16 "
        f"(default: every registered codec: {','.join(codec_names())})",
    )
    cb.add_argument("--numel", type=_positive, default=1 << 20, help="elements (default %(default)s)")
    cb.add_argument("--repeats", type=_positive, default=5, help="timed runs after one warm-up (default %(default)s)")
    cb.add_argument("--threads", type=_positive, default=1, help="torch threads (default %(default)s)")
    cb.add_argument(
        "--device", type=_bench_device, default="cpu",
        help="where the tensors live: cpu (fused C kernels) or cuda[:index] (Triton kernels; default %(default)s)",
    )
    cb.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    cb.add_argument(
        "--plot", dest="plot_path",
        help="draw GB/s per codec against memory-copy speed to this PNG (default with --json: next to it, same name)",
    )
    mb = bench_sub.add_parser(
        "models", help="DDP steps over the gradient sets of real models (ResNet-50, BERT, GPT-2, ViT), per method",
        description="DDP steps over modules with the exact parameter shapes of real models (forward nearly free, "
        "so a step is the gradient exchange), or a real ResNet-18 forward/backward: fp32 DDP, PyTorch's "
        "fp16_compress_hook and gradzip maxmin4 (plus --configs), with wire and codec limits.",
        epilog="examples:\n"
        "  gradzip bench models                                  # all four models, 4 ranks, 1 Gbit/s\n"
        "  gradzip bench models --models resnet50 --rate 100mbit --steps 3\n"
        "  gradzip bench models --models resnet18-real,gpt2 --configs maxmin2,topk,maxmin:bits=8:memory=residual\n"
        "  gradzip bench models --models resnet50 --rate loopback --json out/models.json\n"
        "  gradzip bench models --models resnet50,gpt2 --ranks-per-node 2 \\\n"
        "      --configs maxmin:bits=4:hierarchy=off     # 2 nodes x 2 ranks: hierarchical and flat",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ..bench.models import DEFAULT_MODELS, MODELS

    mb.add_argument(
        "--models", type=_model_list, default=DEFAULT_MODELS,
        help=f"comma-separated models (default {','.join(DEFAULT_MODELS)}); all: {','.join(MODELS)}",
    )
    mb.add_argument("--workers", type=_positive, default=4, help="local ranks (default %(default)s)")
    mb.add_argument(
        "--ranks-per-node", type=_positive, default=1,
        help="ranks per emulated node (default %(default)s): one torchrun per node starts them in the node's "
        "namespace, where they share its one shaped link, so gradzip exchanges hierarchically",
    )
    mb.add_argument(
        "--rate", type=_link_rate, default="1gbit",
        help="emulate a cluster with links of this rate (e.g. 100mbit, 1gbit, 10gbit; needs root and iproute2; "
        "default %(default)s); 'loopback' for none. Without root or iproute2 it says so and runs on loopback",
    )
    mb.add_argument("--steps", type=_positive, default=5, help="timed steps per method after the warm-up (default %(default)s)")
    mb.add_argument(
        "--warmup", type=_positive, default=2,
        help="untimed steps first; DDP rebuilds its buckets after the first (default %(default)s)",
    )
    mb.add_argument(
        "--configs", type=_method_list, default=[],
        help="extra methods besides fp32, torch-fp16 and maxmin4: demo config names (maxmin2, topk, powersgd, "
        "fp16, ...) or codec specs as in bench allreduce (maxmin:bits=8:memory=residual)",
    )
    mb.add_argument(
        "--json", dest="json_path", default=os.path.join("bench-results", "models.json"),
        help="write the results to this JSON file (default %(default)s)",
    )
    mb.add_argument(
        "--plot", dest="plot_path",
        help="draw time per step per model and method to this PNG (default: next to the JSON, same name)",
    )
    sc = bench_sub.add_parser(
        "scale", help="the scaling model: calibrate it here, check it against saved model runs, predict 2..128 nodes",
        description="Calibrates the scaling model's rates on this machine (memory copy, sum, codec, the CPU of "
        "gloo's sockets; the link's efficiency on an emulated cluster where one can be built), predicts every "
        "row of the given 'bench models' reports beside what they measured, and predicts gradzip's speed-up "
        "over fp32 DDP and the fp16 hook for 2..128 nodes x 1..8 ranks at 1, 10, 25 and 100 Gbit/s.",
        epilog="examples:\n"
        "  gradzip bench scale docs/bench/models-2x2-1gbit.json docs/bench/models-4x2-1gbit.json\n"
        "  gradzip bench scale --values 124439808 --json out/scale-gpt2.json   # GPT-2's gradient count\n"
        "  gradzip bench scale new-run.json --rates docs/bench/scale.json      # the same model, a new run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sc.add_argument("reports", nargs="*", help="JSON reports of 'gradzip bench models' to validate against")
    sc.add_argument("--rate", type=_link_rate, default="1gbit", help="link to calibrate on (default %(default)s)")
    sc.add_argument(
        "--values", type=_positive, default=25_557_032, help="gradients per step to predict for (default ResNet-50's)",
    )
    sc.add_argument(
        "--json", dest="json_path", default=os.path.join("bench-results", "scale.json"),
        help="write the results to this JSON file (default %(default)s)",
    )
    sc.add_argument("--plot", dest="plot_path", help="draw the predicted speed-ups to this PNG (default: next to the JSON)")
    sc.add_argument(
        "--rates", dest="rates_path",
        help="take the calibrated rates from this earlier 'bench scale' JSON instead of calibrating again",
    )
    from ..bench.sharded import DEFAULT_CONFIGS as FSDP_CONFIGS

    fb = bench_sub.add_parser(
        "fsdp", help="FSDP2 steps over a real model's gradient set: fp32, bf16 reduce and gradzip's reduce-scatter",
        description="FSDP2 (fully_shard per block, reshard_after_forward off) over a model's parameter shapes with "
        "a forward that costs next to nothing, so a step is the weight all-gather and the gradient reduce-scatter: "
        "fp32 FSDP2, FSDP2 with a bf16 reduce, and gradzip codec specs, on the emulated cluster.",
        epilog="examples:\n"
        "  gradzip bench fsdp                                    # ResNet-50, 4 hosts at 1 Gbit/s\n"
        "  gradzip bench fsdp --configs fp32,maxmin:bits=4 --rate 100mbit\n"
        "  gradzip bench fsdp --workers 4 --ranks-per-node 2   # 2 nodes of 2 ranks: hierarchical reduce-scatter",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fb.add_argument("--model", choices=list(MODELS), default="resnet50", help="gradient set (default %(default)s)")
    fb.add_argument(
        "--configs", type=_fsdp_methods, default=list(FSDP_CONFIGS),
        help=f"methods (default {','.join(FSDP_CONFIGS)}): fp32, bf16-reduce or codec specs as in bench models",
    )
    fb.add_argument("--workers", type=_positive, default=4, help="ranks (default %(default)s)")
    fb.add_argument(
        "--ranks-per-node", type=_positive, default=1,
        help="ranks per emulated node, sharing its link (default %(default)s); above 1 gradzip reduce-scatters "
        "hierarchically (plain inside the node, compressed across) unless a spec says hierarchy=off",
    )
    fb.add_argument("--rate", type=_link_rate, default="1gbit", help="link rate, or loopback (default %(default)s)")
    fb.add_argument("--steps", type=_positive, default=3, help="timed steps per method (default %(default)s)")
    fb.add_argument("--warmup", type=_positive, default=2, help="untimed steps first (default %(default)s)")
    fb.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    from ..bench.memory import DEFAULT_CONFIGS as MEM_CONFIGS

    mm = bench_sub.add_parser(
        "memory", help="peak memory a rank adds during DDP steps over a model's gradient set, beside fp32 DDP",
        description="Each method in processes of its own on local gloo ranks: the peak resident memory a rank "
        "adds from before its first DDP step to the end of the measured steps (gradients, DDP's buckets, the "
        "method's buffers and residuals) in the steady state after --warmup steps, in units of the gradient size "
        "and as the excess over fp32 DDP; beside it, the warm-up steps' own peak (DDP's first pass, its bucket "
        "rebuild). Linux only. With --device cuda, the gradient set on the GPU and the peak memory the caching "
        "allocator has handed out there.",
        epilog="examples:\n"
        "  gradzip bench memory                                   # ResNet-50, 2 ranks\n"
        "  gradzip bench memory --configs fp32,maxmin4,maxmin:bits=4:in_place=true,maxmin:bits=4:memory=residual\n"
        "  gradzip bench memory --model gpt2 --json out/memory.json\n"
        "  gradzip bench memory --device cuda --workers 1          # on a GPU, NCCL",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mm.add_argument("--model", choices=list(MODELS), default="resnet50", help="gradient set (default %(default)s)")
    mm.add_argument(
        "--configs", type=_method_list, default=list(MEM_CONFIGS),
        help=f"methods, fp32 first for the excess column (default {','.join(MEM_CONFIGS)}): demo config names "
        "or codec specs as in bench models",
    )
    mm.add_argument("--workers", type=_positive, default=2, help="local ranks (default %(default)s)")
    mm.add_argument(
        "--warmup", type=_positive, default=3,
        help="steps before the measured ones; DDP rebuilds its buckets at the second, gradzip's buffer pools "
             "plan from the third (default %(default)s)",
    )
    mm.add_argument("--steps", type=_positive, default=3, help="measured steps after the warm-up (default %(default)s)")
    mm.add_argument(
        "--device", default="cpu",
        help="cpu (peak resident memory) or cuda[:index] (peak memory allocated on the GPU; one rank over NCCL, "
        "several sharing the GPU over gloo) (default %(default)s)",
    )
    mm.add_argument("--json", dest="json_path", help="also write the results to this JSON file")

    from ..bench import overhead as oh

    ov = bench_sub.add_parser(
        "overhead", help="what each hook adds to a real training step on one rank (a GPU with --device cuda)",
        description="One rank (NCCL on a GPU, gloo on the CPU), so nothing crosses a wire: each method's median "
        "step over a real model's forward/backward beside fp32 DDP's, the difference (the hook's own work) and "
        "the link rate at which the method's exchange would hide behind the step.",
        epilog="examples:\n"
        "  gradzip bench overhead --device cuda                   # ResNet-50 32x224², GPT-2 small 4x1024\n"
        "  gradzip bench overhead --device cuda --workers 2 --models resnet50 --configs maxmin4,maxmin:bits=4\n"
        "  gradzip bench overhead --models resnet18 --configs fp32,maxmin4 --steps 3   # a quick CPU run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ov.add_argument(
        "--models", type=lambda t: _names(t, oh.MODELS, "model"), default=list(oh.DEFAULT_MODELS),
        help=f"comma-separated models (default {','.join(oh.DEFAULT_MODELS)}; of {','.join(oh.MODELS)}); "
        "batches: 32x224² images and 4x1024 tokens on a GPU, small ones on the CPU",
    )
    ov.add_argument(
        "--configs", type=lambda t: _checked(t, oh.check_config), default=None,
        help=f"methods: demo config names or codec specs as in bench models (default {','.join(oh.DEFAULT_CONFIGS)}; "
        "over gloo without torch-powersgd, which hangs there); fp32 is always measured",
    )
    ov.add_argument("--device", type=_bench_device, default="cpu", help="cpu or cuda[:index] (default %(default)s)")
    ov.add_argument("--profile", action="store_true",
                    help="also profile three steps of each method (torch.profiler); the operator tables go into --json")
    ov.add_argument("--trace", dest="trace_dir", metavar="DIR",
                    help="also write those three profiled steps as a Chrome trace per model and method "
                    "(DIR/<model>-<method>.json.gz, rank 0's; open in https://ui.perfetto.dev): where the "
                    "side stream and the comm thread wait")
    ov.add_argument(
        "--workers", type=_positive, default=1,
        help="ranks sharing the device (default %(default)s: NCCL on a GPU; more: gloo, a real exchange)",
    )
    ov.add_argument("--steps", type=_positive, default=20,
                    help="timed steps per method, taken two at a time in turns of all methods (default %(default)s)")
    ov.add_argument("--warmup", type=_at_least_two, default=3, help="untimed steps first, at least 2 (default %(default)s)")
    ov.add_argument("--bucket-view", action="store_true",
                    help="build every method's DDP (fp32's too) with gradient_as_bucket_view=True: no copy of the "
                    "averages into .grad after the exchange")
    ov.add_argument("--json", dest="json_path", help="also write the results to this JSON file")

    from ..bench.accuracy import DEFAULT_CONFIGS as ACC_CONFIGS
    from ..bench.accuracy import DEFAULT_TASKS, FRONTENDS, FSDP_CONFIGS, QUICK, TASKS

    acc = bench_sub.add_parser(
        "accuracy", help="held-out loss at equal steps, bytes and time-to-target per method, on real data, over seeds",
        description="Train a digits MLP and a character-level transformer LM (pydoc_data.topics) on local gloo ranks, "
        "once per method and seed from the same initial parameters and batches: held-out loss (mean and min–max over "
        "seeds), bytes per step, training time, the time to reach fp32's final held-out loss, and whether all "
        "replicas stayed bit-identical (exit status 1 if not).",
        epilog="examples:\n"
        "  gradzip bench accuracy --json docs/bench/accuracy.json             # defaults: both tasks, 3 seeds\n"
        "  gradzip bench accuracy --quick --rate loopback\n"
        "  gradzip bench accuracy --tasks charlm --configs fp32,maxmin2,qsgd4,topk:ratio=0.05,powersgd:rank=8\n"
        "  gradzip bench accuracy --configs fp32,signsgd:opt.lr=0.002:opt.momentum=0 --seeds 5\n"
        "  gradzip bench accuracy --frontend fsdp            # fp32 FSDP2, bf16 reduce, gradzip, gradzip + 8-bit weights",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    acc.add_argument(
        "--tasks", type=_accuracy_tasks, default=DEFAULT_TASKS,
        help=f"comma-separated tasks (default {','.join(DEFAULT_TASKS)}); all: {','.join(TASKS)}",
    )
    acc.add_argument(
        "--configs", type=_accuracy_configs, default=None,
        help=f"comma-separated methods (default {','.join(ACC_CONFIGS)}; with --frontend fsdp "
        f"{','.join(FSDP_CONFIGS)}): demo config names (fp32, fp16, maxmin4, "
        "qsgd4, topk, powersgd, torch-fp16, ...) or codec specs name[:key=value...]; keys of gradzip.register "
        "(memory, collective, min_numel, weight_bits, ...) go to it, opt.lr / opt.momentum to the optimizer, others "
        "to the codec; bf16-reduce is FSDP2's own bf16 reduce",
    )
    acc.add_argument(
        "--frontend", choices=FRONTENDS, default="ddp",
        help="train with DistributedDataParallel (gradzip's all-reduce hook) or FSDP2 (fully_shard per block, "
        "gradzip's reduce-scatter); default %(default)s",
    )
    acc.add_argument("--seeds", type=_positive, default=None, help="seeds 0..N-1 (default 3; --quick: 2)")
    acc.add_argument("--steps", type=_positive, default=None, help="training steps of every task (default: per task, "
                     "digits 120, charlm 150; --quick: 40)")
    acc.add_argument("--eval-every", type=_positive, default=None, help="held-out evaluation every K steps "
                     "(default: per task, digits 10, charlm 15; --quick: 10)")
    acc.add_argument("--workers", type=_positive, default=4, help="local ranks (default %(default)s)")
    acc.add_argument(
        "--rate", type=_link_rate, default="1gbit",
        help="emulate a cluster with links of this rate (needs root and iproute2; default %(default)s); 'loopback' "
        "for none. Without root or iproute2 it says so and runs on loopback",
    )
    acc.add_argument(
        "--tolerance", type=float, default=0.0,
        help="time-to-target aims at the baseline's final held-out loss × (1 + this) (default %(default)s)",
    )
    acc.add_argument(
        "--quick", action="store_true",
        help=f"a smoke run: {QUICK['steps']} steps, eval every {QUICK['eval_every']}, {QUICK['seeds']} seeds "
        "(explicit options win)",
    )
    acc.add_argument("--json", dest="json_path", help="write the results to this JSON file")
    acc.add_argument(
        "--plot", dest="plot_path",
        help="draw held-out loss against bytes sent and training time to this PNG (default: next to the JSON)",
    )
    return parser


def _console():
    from ..bench.tables import console

    return console()  # rich's (pipes and logs get the whole table), or plain text without rich


def _plot(draw: Callable[[Dict[str, Any], str], None], report: Dict[str, Any], args: argparse.Namespace, console: Any) -> None:
    """Draw ``report`` to ``--plot``, or next to ``--json`` when only that was given.

    A missing matplotlib fails an explicit ``--plot`` and only skips the implicit one, each with a
    line naming the extra to install.
    """
    path = args.plot_path
    if path is None and args.json_path:
        path = os.path.splitext(args.json_path)[0] + ".png"
    if path is None:
        return
    try:
        draw(report, path)
    except ImportError as exc:
        why = f"no plot: {(exc.name or 'matplotlib').split('.')[0]} is not installed (pip install gradzip[bench])"
        if args.plot_path:
            raise SystemExit(f"gradzip: {why}")
        print(why)
        return
    console.print(f"plot: {path}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # torchrun's options and the script's own: parsed by gradzip.tools.run alone
        from . import run

        return run.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from . import doctor

        return doctor.main()
    if args.command == "demo":
        from . import demo

        try:
            report = demo.run_demo(
                args.configs, out=args.out, workers=args.workers, epochs=args.epochs,
                batch_size=args.batch_size, lr=args.lr, momentum=args.momentum, seed=args.seed,
                width=args.width, rate=args.rate, ranks_per_node=args.ranks_per_node,
                echo=lambda line: print(line, flush=True),
            )
        except ImportError as exc:  # the data set needs scikit-learn (the 'demo' extra)
            raise SystemExit(f"gradzip demo: {exc}")
        console = _console()
        print("\n".join([""] + report["headline"] + [""]), flush=True)
        console.print(demo.table(report))
        if report.get("plot_skipped"):
            print(report["plot_skipped"])
        print(f"total wall time {report['total_wall_s']:.1f} s; results in {args.out}/", flush=True)
        return 0 if all(r.get("identical", True) for r in report["results"]) else 1  # failed baselines are rows
    if args.command == "bench" and args.bench == "allreduce":
        from ..bench import micro, plots

        report = micro.run_allreduce(
            args.workers, args.size_mb, args.repeats, args.codecs, args.json_path, args.rate, sizes_mb=args.sizes,
        )
        console = _console()
        console.print(micro.table(report))
        _plot(plots.allreduce, report, args, console)
        return 0
    if args.command == "bench" and args.bench == "codecs":
        from ..bench import codecs as codec_bench
        from ..bench import plots

        report = codec_bench.run(args.codecs, args.numel, args.repeats, args.threads, args.json_path, args.device)
        console = _console()
        console.print(codec_bench.table(report))
        _plot(plots.codecs, report, args, console)
        return 0
    if args.command == "bench" and args.bench == "models":
        from ..bench import models, plots

        if os.path.dirname(args.json_path):
            os.makedirs(os.path.dirname(args.json_path), exist_ok=True)
        report = models.run_models(
            args.models, args.configs, args.workers, args.rate, args.steps, args.warmup, json_path=args.json_path,
            ranks_per_node=args.ranks_per_node,
        )
        console = _console()
        console.print(models.table(report))
        if report["fallback"]:
            console.print(report["fallback"], markup=False)  # (it quotes tc's errors, brackets and all)
        console.print(f"results: {args.json_path} ({report['wall_s']:.0f} s)")
        _plot(plots.models, report, args, console)
        return 0
    if args.command == "bench" and args.bench == "scale":
        from ..bench import scaling

        if os.path.dirname(args.json_path):
            os.makedirs(os.path.dirname(args.json_path), exist_ok=True)
        try:
            rates = scaling.load_rates(args.rates_path) if args.rates_path else None
            report = scaling.run_scale(args.reports, args.rate or "1gbit", args.json_path, values=args.values,
                                       rates=rates)
        except (OSError, KeyError, ValueError) as exc:  # a report or rates file that is not one
            raise SystemExit(f"gradzip bench scale: {exc}")
        console = _console()
        for t in scaling.tables(report):
            console.print(t)
        for per_node, bps in report["break_even_bps_16_nodes"].items():
            where = "beyond 1 Tbit/s" if bps is None else f"{bps / 1e9:.0f} Gbit/s"
            console.print(f"16 nodes x {per_node}: gradzip stops beating the fp16 hook at {where}")
        console.print(f"results: {args.json_path}")
        _plot(scaling.plot, report, args, console)
        return 0
    if args.command == "bench" and args.bench == "fsdp":
        from ..bench import sharded

        return _bench_report("fsdp", lambda: sharded.run_fsdp(
            args.model, args.configs, args.workers, args.rate, args.steps, args.warmup, args.json_path,
            ranks_per_node=args.ranks_per_node,
        ), sharded.table, args.json_path)
    if args.command == "bench" and args.bench == "overhead":
        from ..bench import overhead

        return _bench_report("overhead", lambda: overhead.run(
            args.models, args.configs, args.device, args.steps, args.warmup, args.json_path, args.workers,
            profile=args.profile, trace_dir=args.trace_dir, bucket_view=args.bucket_view,
        ), overhead.table, args.json_path)
    if args.command == "bench" and args.bench == "memory":
        from ..bench import memory

        try:
            report = memory.run_memory(
                args.model, args.configs, args.workers, args.steps, json_path=args.json_path, warmup=args.warmup,
                device=args.device,
            )
        except ValueError as exc:
            raise SystemExit(f"gradzip bench memory: {exc}")
        except RuntimeError as exc:
            raise SystemExit(str(exc))
        console = _console()
        console.print(memory.table(report))
        if args.json_path:
            console.print(f"results: {args.json_path} ({report['wall_s']:.0f} s)")
        return 0
    if args.command == "bench" and args.bench == "accuracy":
        from ..bench import accuracy

        if args.tolerance < 0:
            raise SystemExit("gradzip bench accuracy: --tolerance must be at least 0")
        quick = accuracy.QUICK if args.quick else {}
        try:
            report = accuracy.run_accuracy(
                args.tasks, args.configs or (accuracy.FSDP_CONFIGS if args.frontend == "fsdp" else accuracy.DEFAULT_CONFIGS),
                seeds=args.seeds or quick.get("seeds", accuracy.DEFAULTS["seeds"]),
                steps=args.steps or quick.get("steps"), eval_every=args.eval_every or quick.get("eval_every"),
                workers=args.workers, rate=args.rate, tolerance=args.tolerance, json_path=args.json_path,
                frontend=args.frontend,
            )
        except ImportError as exc:  # the digits data set needs scikit-learn (the 'demo' extra)
            raise SystemExit(f"gradzip bench accuracy: {exc}")
        except ValueError as exc:
            raise SystemExit(f"gradzip bench accuracy: {exc}")
        console = _console()
        if report["fallback"]:
            console.print(report["fallback"], markup=False)  # (it quotes tc's errors, brackets and all)
        console.print(accuracy.table(report))
        if args.json_path:
            console.print(f"results: {args.json_path} ({report['wall_s']:.0f} s)")
        else:
            console.print(f"total wall time {report['wall_s']:.0f} s")
        _plot(accuracy.plot, report, args, console)
        if not accuracy.all_identical(report):
            drifted = [
                f"{t} {r['config']}" for t, res in report["results"].items() for r in res["rows"] if not r["identical"]
            ]
            console.print("[red]replicas differ[/red] after training with: " + ", ".join(drifted))
            return 1
        return 0
    raise AssertionError(args)  # argparse rejects everything else


if __name__ == "__main__":
    sys.exit(main())
