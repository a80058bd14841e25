#!/usr/bin/env bash
# The in-process CPU engine on the H100 host under several settings (after scripts/h100-builds.sh start/stash/assemble):
#   VARIANTS="default threads8 threads4 threads12 spin0 blas1 blas1t15 package package8" bash benchmarks/h100-inprocess-cpu.sh
# One single-stream `gateway bench` (4 x 128+128 tokens) per variant; the libraries the server mapped -> $OUT.
export PYTHONPATH=/tmp/h15/site:$PWD
lib=/tmp/h15/build/bin
for variant in ${VARIANTS:-default threads8 spin0}; do
  env=(GATEWAY_WORKERS=0 LLAMA_CPP_LIB_PATH=$lib GATEWAY_LOG_LEVEL=warning)
  [ $variant = threads8 ] && env+=(GATEWAY_THREADS=8)
  [ $variant = spin0 ] && env+=(GOMP_SPINCOUNT=0 OMP_WAIT_POLICY=PASSIVE)
  [ $variant = blas1 ] && env+=(OPENBLAS_NUM_THREADS=1)
  [ $variant = threads4 ] && env+=(GATEWAY_THREADS=4)
  [ $variant = threads12 ] && env+=(GATEWAY_THREADS=12)
  [ $variant = package ] && env=(GATEWAY_WORKERS=0 GATEWAY_LOG_LEVEL=warning)
  [ $variant = package8 ] && env=(GATEWAY_WORKERS=0 GATEWAY_LOG_LEVEL=warning GATEWAY_THREADS=8)
  [ $variant = blas1t15 ] && env+=(OPENBLAS_NUM_THREADS=1 GATEWAY_THREADS=15)
  env "${env[@]}" python3 -m gateway.cli serve --engine cpu --port 18300 > $OUT/exp-$variant.log 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do curl -sf localhost:18300/health > /dev/null && break; sleep 1; done
  python3 -m gateway.cli bench --url http://127.0.0.1:18300 --concurrency 1 --num-prompts 4 --input-len 128 --output-len 128 --quiet --json $OUT/exp.json > /dev/null 2>&1
  python3 -c "import json; r=json.load(open('$OUT/exp.json')); print('$variant', round(r['output_token_throughput'],1), 'tok/s')"
  grep -oE "/[^ ]*libggml[^ ]*\.so[^ ]*|/[^ ]*libllama[^ ]*\.so[^ ]*|/[^ ]*libgomp[^ ]*|/[^ ]*openblas[^ ]*" /proc/$pid/maps | sort -u > $OUT/maps-$variant.txt
  [ $variant = default ] && cat $OUT/maps-$variant.txt
  kill -TERM $pid; wait $pid
done
