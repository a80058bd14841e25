#!/bin/bash
# A/B: HEAD vs session 18's f29f4ae (same venv, same wheels), c=1 and c=16, alternated rounds
P1=18111; P2=18112
(cd /work/main && GATEWAY_LOG_LEVEL=warning .venv/bin/python -m gateway.cli serve --port $P1 --parallel 16 --engine cpu > /tmp/s20/h.log 2>&1) &
(cd /tmp/s18tree && GATEWAY_LOG_LEVEL=warning /work/main/.venv/bin/python -m gateway.cli serve --port $P2 --parallel 16 --engine cpu > /tmp/s20/o.log 2>&1) &
for p in $P1 $P2; do for i in $(seq 180); do curl -sf localhost:$p/health >/dev/null && break; sleep 1; done; done
cd /work/main
for r in 1 2 3; do
  for c in 1 16; do
  for p in $P1 $P2; do
    .venv/bin/python -m gateway.cli bench --url http://127.0.0.1:$p --model smollm2-135m-instruct --concurrency $c --num-prompts $((c>1?c:4)) --input-len 128 --output-len 64 --seed $r --quiet --json /tmp/s20/ab2-$p-$c-$r.json >/dev/null
    python3 -c "import json;d=json.load(open('/tmp/s20/ab2-$p-$c-$r.json'));print($p,$c,$r,round(d['output_token_throughput'],1),round(d['ttft']['p50'],3))"
  done; done
done
pkill -f "port $P1" ; pkill -f "port $P2"; wait
