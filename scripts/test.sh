#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole test suite.
# The default selection runs in two pytest workers (pytest-xdist): a multi-rank test spends much
# of its time with its ranks starting and waiting on each other, so two workers share two cores
# well (about 1.4x faster than one here). `-n N` given here takes the place of two workers and
# `-p no:xdist` runs the tests in this process. A selection that may hold the slow tests runs in
# one process (`-n 0`, which a later `-n N` overrides): they time their emulated links.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=(-n 2)
# SLURM (installed where it can be) only for a selection that may hold the slow tests
case " $* " in *"not slow"*) ;; *slow*) export SLURM=1; workers=(-n 0) ;; esac
case " $* " in *"no:xdist"*) workers=() ;; esac
bash scripts/setup.sh test
.venv/bin/python -m compileall -q tests >/dev/null  # (the ranks import the test modules: see setup.sh)
exec .venv/bin/python -m pytest -q "${workers[@]}" "$@"
