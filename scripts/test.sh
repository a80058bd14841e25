#!/usr/bin/env bash
# Set up with the test dependencies (idempotent, cached), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
.venv/bin/ruff check gateway engines tests
exec .venv/bin/python -m pytest -q "$@"
