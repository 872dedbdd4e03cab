#!/usr/bin/env bash
# Install what the demo needs (first run only) and train on 4 local workers, fp32 vs codecs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/gradzip demo "$@"
