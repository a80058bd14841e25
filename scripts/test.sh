#!/usr/bin/env bash
# Set up with the test dependencies (idempotent, cached), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# The deploy/ tests run the real promtool and Prometheus server (Debian's package).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus
fi
.venv/bin/ruff check gateway engines tests
exec .venv/bin/python -m pytest -q "$@"
