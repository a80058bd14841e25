#!/bin/bash
# A/B: follow on vs off, c=16, alternated rounds
cd /work/main
P1=18101; P2=18102
GATEWAY_LOG_LEVEL=warning .venv/bin/python -m gateway.cli serve --port $P1 --parallel 16 --engine cpu > /tmp/s20/a.log 2>&1 &
A=$!
GATEWAY_LOG_LEVEL=warning GATEWAY_PREFIX_FOLLOW=off .venv/bin/python -m gateway.cli serve --port $P2 --parallel 16 --engine cpu > /tmp/s20/b.log 2>&1 &
B=$!
for p in $P1 $P2; do for i in $(seq 120); do curl -sf localhost:$p/health >/dev/null && break; sleep 1; done; done
for r in 1 2 3; do
  for p in $P1 $P2; do
    .venv/bin/python -m gateway.cli bench --url http://127.0.0.1:$p --model smollm2-135m-instruct --concurrency ${C:-16} --num-prompts ${C:-16} --input-len 128 --output-len 64 --seed $r --quiet --json /tmp/s20/ab-$p-$r.json >/dev/null
    python3 -c "import json;d=json.load(open('/tmp/s20/ab-$p-$r.json'));print($p,$r,{k:d[k] for k in d if 'tok' in k or 'ttft' in k})"
  done
done
for p in $P1 $P2; do curl -s localhost:$p/metrics | grep -E "^gateway_kv_prefix_(follows|copies)_total"; done
kill $A $B; wait
