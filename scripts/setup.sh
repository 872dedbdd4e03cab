#!/usr/bin/env bash
# Create .venv (once) and install gradzip into it, editable, with the extras named in $1.
# torch: a machine that already holds the CPU build of torch 2.13.0 installs it from disk; any
# other machine gets the newest torch>=2.4 that pip finds.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
py=.venv/bin/python
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>/dev/null \
    || "$py" -m pip install -q --disable-pip-version-check "torch>=2.4"
fi
# the editable install follows the source by itself; pip runs again only when pyproject.toml
# (the dependencies) changed since the last install of these extras (about 20 s saved a run)
stamp=".venv/.installed-$extras"
want=$(cksum < pyproject.toml)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] \
    || ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gradzip') is None)"; then
  if ! log=$("$py" -m pip install -q --disable-pip-version-check -e ".[$extras]" 2>&1); then
    echo "$log" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
# the slow tests (scripts/test.sh -m slow sets SLURM=1) on Debian as root: SLURM too, so the
# launch tests run srun on the emulated nodes (tests/test_slurm.py; elsewhere they skip and say
# what to install); the default suite has no use for it
if [ "${SLURM:-}" = "1" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! command -v slurmd >/dev/null && [ ! -x /usr/sbin/slurmd ]; then
  { timeout 300 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq \
      --no-install-recommends slurmd slurmctld slurm-client munge; } >/dev/null 2>&1 \
    || echo "SLURM could not be installed: its launch tests will skip" >&2
fi
# bytecode for the editable source, once: every rank and launched process imports gradzip, and
# where PYTHONDONTWRITEBYTECODE is set each would compile it again (about 0.3 s of CPU apiece)
"$py" -m compileall -q src >/dev/null
"$py" -c "import gradzip, torch; print(f'gradzip {gradzip.__version__} with torch {torch.__version__}')"
