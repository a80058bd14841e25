#!/usr/bin/env bash
# Set up (idempotent, cached) and serve the default model on http://127.0.0.1:8080/v1.
# Extra arguments go to `gateway serve` (e.g. --port 9000, --model gemma-3-270m).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gateway serve "$@"
