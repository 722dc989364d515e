#!/bin/bash
# Three nanoserve servers sharing this machine, one 200-token request to each at once, against one
# alone (the same server, warm). Run on an idle machine from the project root; EXTRA adds flags.
cd "$(dirname "$0")/../.."
MD=${MODEL_DIR:-$HOME/.cache/nanoserve/models/SmolLM2-135M-Instruct}
EXTRA=${EXTRA:-}
req() { curl -s -o /dev/null -w "%{time_total}\n" http://127.0.0.1:$1/v1/completions -H 'Content-Type: application/json' -d '{"model":"m","prompt":"Once upon a time","max_tokens":200,"ignore_eos":true,"temperature":0}'; }
pids=""
for p in 8101 8102 8103; do .venv/bin/nanoserve serve --model $MD --served-model-name m --port $p $EXTRA > /tmp/three_$p.log 2>&1 & pids="$pids $!"; done
for p in 8101 8102 8103; do for i in $(seq 1 120); do curl -sf 127.0.0.1:$p/health >/dev/null && break; sleep 0.5; done; done
req 8101 >/dev/null  # warm
echo "alone: $(req 8101) s"
req 8102 > /dev/null; req 8103 > /dev/null
echo "three at once:"; (req 8101 & req 8102 & req 8103 & wait)
kill $pids; wait 2>/dev/null
