#!/usr/bin/env bash
# Install what the demo needs (first run only) and train on 4 local workers, fp32 vs codecs, on an
# emulated 100 Mbit/s cluster where root and iproute2 allow (the demo checks; else loopback, and it says so).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/gradzip demo "$@"
