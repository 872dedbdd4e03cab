#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# SLURM (installed where it can be) only for a selection that may hold the slow tests
case " $* " in *"not slow"*) ;; *slow*) export SLURM=1 ;; esac
bash scripts/setup.sh test
.venv/bin/python -m compileall -q tests >/dev/null  # (the ranks import the test modules: see setup.sh)
exec .venv/bin/python -m pytest -q "$@"
