#!/usr/bin/env bash
# Agent-sized prompts on the lent H100 (issue 28), as run there: a Llama-3-8B-shaped Q4_K_M GGUF
# with random weights, the gateway on the CUDA build and llama-server from the same source.
# That machine has CUDA 13, Python 3.12 and no package registry; what it lacks travels in
# git-ignored folders, each call under 64 MiB:
#   .whl/          cp312 wheels of requirements/serve.txt (pip download --python-version 3.12)
#   .dev28/        llama-src-tools.tar.gz: the pinned llama-cpp-python sdist without docs, tests,
#                  other backends and vocab files, but with llama-server, llama-quantize, gguf-py and
#                  models/ggml-vocab-llama-bpe.gguf (Llama 3's tokenizer and hyperparameters)
#   scripts/h100-prefix.sh setup     install the wheels, unpack the source, start the CUDA build
#   scripts/h100-prefix.sh model     wait for the build; write the F16 GGUF and quantize it to Q4_K_M
#   scripts/h100-prefix.sh agent|interference   bench_prefix_cache.py's part on CUDA -> $OUT
#                                    (agent: AGENT_PARALLEL=2 sequences; VARIANT='NAME:VAR=VALUE' adds a
#                                    gateway with that environment, e.g. 'pageable:GATEWAY_PINNED_HOST_CACHE=0';
#                                    AGENT_ARGS: more bench_prefix_cache.py options, e.g. --agent-skip-nocache)
#                                    (interference: BUDGETS=256,512 UNIFIED_BUDGETS=256,512 to choose; VARIANT and
#                                    VARIANT2 add gateways with that environment at the first budget, e.g.
#                                    'long prompts, 120 SMs:GATEWAY_LONG_PROMPT_TOKENS=4096,GATEWAY_LONG_PROMPT_SMS=120')
#                                    (interference: ROUNDS=4 long prompts per server, SENDER=process,loop: sent in
#                                    turn by a client process of their own / the streams' client; default 1, process)
#                                    (both: ONLY='name;name' runs only those servers; BENCH_LOG_LEVEL=debug
#                                    brings back each server's log, the engine's pass-by-pass lines, gzipped)
#   scripts/h100-prefix.sh probe     benchmarks/probe_two_contexts.py: the long prompt prefilled in a second
#                                    context beside 32 decoding streams vs chunked into their steps -> $OUT
#                                    (CHUNK=, BUDGETS=, TAG=; PRIORITY=1: the decoding context's CUDA streams at
#                                    the highest priority; GREEN=96,112: more second contexts, each held to a
#                                    green context of that many SMs; both by scripts/patches-h100/ggml-cuda-streams.patch)
#   scripts/h100-prefix.sh stash D   keep D's parts of the SmolLM2 GGUF (.dev27/a, b, c: split -b 33M)
#   scripts/h100-prefix.sh conversations   join them; bench_prefix_cache.py's conversations part -> $OUT
#   scripts/h100-prefix.sh memory    bench_memory.py on CUDA (issue 29): the estimate vs the worker's
#                                    resident memory and its memory on the GPU (nvidia-smi) -> $OUT
set -uo pipefail
W=/tmp/h28
mkdir -p "$W/site"
export PYTHONPATH="$W/site:$W/src:$PWD" LLAMA_CPP_LIB_PATH="$W/build/bin" PYTHONUNBUFFERED=1
V="$W/src/vendor/llama.cpp"
# The servers' logs (bench-NAME.log) go to $TMPDIR; with BENCH_LOG_LEVEL set they come back in $OUT.
export TMPDIR="$W/logs-${1:-none}-$$"
mkdir -p "$TMPDIR"
logs_back() {
  if [ -n "${BENCH_LOG_LEVEL:-}" ]; then
    for f in "$TMPDIR"/bench-*.log; do [ -e "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
  fi
}
. "$(dirname "$0")/h100-common.sh"
case "${1:-}" in
setup)
  h100_install
  h100_build llama llama-server llama-quantize
  ;;
model)
  # The F16 file is written while the build runs; then quantized.
  if [ ! -s "$W/llama8b-f16.gguf" ]; then
    PYTHONPATH="$V/gguf-py:$W/site" python3 benchmarks/make_random_llama8b.py "$V/models/ggml-vocab-llama-bpe.gguf" \
      "$W/llama8b-f16.gguf" --ctx 32768
  fi
  h100_wait_build 400
  [ -s "$W/llama8b-q4_k_m.gguf" ] || "$W/build/bin/llama-quantize" "$W/llama8b-f16.gguf" "$W/llama8b-q4_k_m.gguf" Q4_K_M 16 | tail -3
  ls -la "$W"/*.gguf
  cat > "$W/models.yaml" <<EOY
default: llama3-8b-random
models:
  - id: llama3-8b-random
    description: Llama-3-8B-shaped, random weights, Q4_K_M (speed only)
    context_length: 32768
    formats: {gguf: {path: $W/llama8b-q4_k_m.gguf}}
  - id: llama3-8b-random-13k
    description: the same file, 13k tokens per sequence (33 sequences fit the H100 with it)
    context_length: 13312
    formats: {gguf: {path: $W/llama8b-q4_k_m.gguf}}
  - id: smollm2-135m-instruct
    description: SmolLM2-135M-Instruct Q4_1 (from the parts kept by 'stash')
    context_length: 2048
    formats: {gguf: {path: $W/smollm2.gguf}}
EOY
  ;;
agent)
  python3 benchmarks/bench_prefix_cache.py --backend cuda --server-bin "$W/build/bin" --config "$W/models.yaml" \
    --parts agent --model llama3-8b-random --agent-sessions 4 --agent-parallel "${AGENT_PARALLEL:-2}" \
    ${VARIANT:+--gateway-variant "$VARIANT"} ${AGENT_ARGS:-} --only "${ONLY:-}" \
    --json "$OUT/agent-p${AGENT_PARALLEL:-2}.json" 2>&1 | tail -14 | tee "$OUT/agent-p${AGENT_PARALLEL:-2}.md"
  logs_back
  ;;
probe)
  python3 benchmarks/probe_two_contexts.py "$W/llama8b-q4_k_m.gguf" --gpu --streams "${STREAMS:-32}" \
    --prompt "${PROMPT:-11264}" --chunk "${CHUNK:-512}" --budgets "${BUDGETS:-256,512}" ${PRIORITY:+--priority} \
    ${GREEN:+--green-sms "$GREEN"} \
    --json "$OUT/probe${TAG:-}.json" 2>&1 | tee "$OUT/probe${TAG:-}.md"
  ;;
stash)
  mkdir -p "$W/stash" && cp "$2"/model.part-* "$W/stash/" && ls "$W/stash"
  ;;
conversations)
  [ -s "$W/smollm2.gguf" ] || cat "$W"/stash/model.part-* > "$W/smollm2.gguf"
  sha256sum "$W/smollm2.gguf"
  python3 benchmarks/bench_prefix_cache.py --backend cuda --server-bin "$W/build/bin" --config "$W/models.yaml" \
    --parts conversations --json "$OUT/conversations.json" 2>&1 | tail -14 | tee "$OUT/conversations.md"
  ;;
interference)
  python3 benchmarks/bench_prefix_cache.py --backend cuda --server-bin "$W/build/bin" --config "$W/models.yaml" \
    --parts interference --model llama3-8b-random --long-model llama3-8b-random-13k --streams 32 \
    --long-words 9000 --budgets "${BUDGETS:-512,2048}" --unified-budgets "${UNIFIED_BUDGETS:-}" --only "${ONLY:-}" \
    --rounds "${ROUNDS:-1}" --long-sender "${SENDER:-process}" \
    ${VARIANT:+--gateway-variant "$VARIANT"} ${VARIANT2:+--gateway-variant "$VARIANT2"} \
    --json "$OUT/interference${TAG:-}.json" 2>&1 | tail -$((14 + ${ROUNDS:-1} * 6)) | tee "$OUT/interference${TAG:-}.md"
  logs_back
  ;;
memory)
  python3 benchmarks/bench_memory.py --engine cuda --models "" --gguf "$W/llama8b-q4_k_m.gguf" \
    --configs "${CONFIGS:-2048x1,8192x1,8192x4,32768x1,8192x16}" --json "$OUT/memory.json" 2>&1 | tee "$OUT/memory.md"
  ;;
esac
