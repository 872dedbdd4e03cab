#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole test suite.
# The default selection runs in two pytest workers (pytest-xdist): most of a multi-rank test's
# time is its ranks starting and waiting on each other, so two share two cores well (about 1.3–1.4× faster than one); `-n N`
# given here takes its place, `-p no:xdist` runs it in this process. A selection that may hold
# the slow tests runs in one: those build emulated clusters and time their links.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=(-n 2 --dist loadgroup)
# SLURM (installed where it can be) only for a selection that may hold the slow tests
case " $* " in *"not slow"*) ;; *slow*) export SLURM=1; workers=(-p no:xdist) ;; esac
case " $* " in *"no:xdist"*) workers=() ;; esac
bash scripts/setup.sh test
.venv/bin/python -m compileall -q tests >/dev/null  # (the ranks import the test modules: see setup.sh)
exec .venv/bin/python -m pytest -q "${workers[@]}" "$@"
