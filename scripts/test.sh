#!/usr/bin/env bash
# Set up with the test dependencies (idempotent, cached), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# The Vulkan build (installed as the package): CI serves through it on Mesa's lavapipe (a software
# Vulkan device). The CPU-only build side by side: CPU engines run on it, each in its own worker
# process, so the two builds serve at once (tests/test_builds.py).
bash scripts/setup.sh --dev --backend vulkan,cpu
sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || ! command -v cc >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 gcc
fi
# The deploy/ tests run the real promtool and Prometheus server (Debian's package).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus
fi
# The web page's browser tests drive Debian's chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium
fi
# The agent CLIs run against the gateway (tests/test_agents.py), from their hash-pinned npm lock.
if ! command -v npm >/dev/null; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nodejs npm
fi
stamp=tests/agents/node_modules/.installed-from
lock_sum=$(sha256sum tests/agents/package-lock.json | cut -c1-64)
if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_sum" ]; then
  npm ci --prefix tests/agents --no-audit --no-fund --loglevel=error
  echo "$lock_sum" > "$stamp"
fi
# ExecuTorch's Vulkan backend for the installed wheel (scripts/install-executorch.sh: ~5 min on 2
# cores, then cached). Its sources are in no package registry: it fetches the pinned commits from
# GitHub or takes local copies (EXECUTORCH_GIT, VOLK_GIT, VMA_GIT); with neither it exits 3 and the
# Vulkan-delegate tests skip with that reason; any other failure stops here.
rc=0; bash scripts/install-executorch.sh vulkan >/dev/null || rc=$?
[ "$rc" = 0 ] || [ "$rc" = 3 ] || exit "$rc"
.venv/bin/ruff check gateway engines tests
.venv/bin/mypy gateway engines  # strict (pyproject.toml): 0 errors
exec .venv/bin/python -m pytest -q "$@"
