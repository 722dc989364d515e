#!/bin/bash
# Served, one GGUF file (issue 51): llama.cpp's llama-server against `nanoserve serve`, each alone on
# the machine, one after the other, the same plain client (../shared/bench/plain_client.py: token-id
# prompts of 128, not streamed, greedy, ignore_eos, each server's own usage counted). Run on an idle
# machine from the project root after `make install`, ../shared/bench/setup-llamacpp-tools.sh and
# ../shared/bench/real-shapes.sh:
#   benchmarks/real-shapes/bench_served.sh [SHAPE] [TYPE]          (default llama-3.2-1b Q4_K_M)
# Prints per server: the first token of a 128-token prompt (p50 of 8 requests of 1 token out; the
# client's prompts repeat from run to run, so 2 of the 8 are in either server's prefix cache), the
# c=1 time per output token (1 / the c=1 output rate: 4 requests of 128 out whose prompts the
# cache holds, as a chat's next turn), output tokens/s at c=1, 4 and 16, and the server's resident
# memory after the runs (VmRSS) and at its peak (VmHWM).
# Appends to benchmarks/real-shapes/<cpu>/served-SHAPE-TYPE.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
SHAPE=${1:-llama-3.2-1b}
TYPE=${2:-Q4_K_M}
R=${REAL_SHAPES:-$HOME/.cache/llamacpp/real-shapes}
BIN=${LLAMACPP_TOOLS:-$HOME/.cache/llamacpp/tools}/build/bin
FILE=$R/$SHAPE/$TYPE.gguf
CLIENT=${BENCH:-$(pwd)/../shared/bench}/plain_client.py
PORT=${PORT:-8177}
CPU=$(lscpu | sed -n 's/^Model name: *//p')
DIR=benchmarks/real-shapes/$(python3 benchmarks/real-shapes/bench_real_shapes.py --cpu-folder)
mkdir -p "$DIR"
OUT=$DIR/served-$SHAPE-$TYPE.txt
URL=http://127.0.0.1:$PORT
echo "# $(date -u +%FT%TZ) $CPU, $(nproc) CPUs, nanoserve $(git rev-parse --short HEAD), $FILE" | tee -a "$OUT"

p50() { python3 "$CLIENT" "$URL" m "$1" "$2" 128 "$3" | sed -n 's/.*req_latency_p50_ms=\([0-9]*\).*/\1/p'; }
rate() { python3 "$CLIENT" "$URL" m "$1" "$2" 128 128 | sed -n 's/.*out_tok\/s=\([0-9.]*\).*/\1/p'; }

measure() {  # name pid
  local name=$1 pid=$2
  for _ in $(seq 1 600); do curl -sf "$URL/health" >/dev/null 2>&1 && break; sleep 1; done
  python3 "$CLIENT" "$URL" m 1 2 128 16 >/dev/null  # warm
  local first c1 c4 c16
  first=$(p50 1 8 1)
  c1=$(rate 1 4); c4=$(rate 4 16); c16=$(rate 16 32)
  local rss hwm
  rss=$(awk '/VmRSS/{print int($2/1024)}' /proc/$pid/status)
  hwm=$(awk '/VmHWM/{print int($2/1024)}' /proc/$pid/status)
  echo "$name first_token_ms=$first tpot_ms=$(python3 -c "print(round(1000 / $c1, 1))") c1_tok_s=$c1 c4_tok_s=$c4 c16_tok_s=$c16 rss_mib=$rss peak_mib=$hwm" | tee -a "$OUT"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

"$BIN/llama-server" -m "$FILE" -t 2 -np 16 -c 5120 --port "$PORT" -a m > /tmp/bench_served_llama.log 2>&1 &
measure "llama-server -np 16 -c 5120" $!
.venv/bin/nanoserve serve --model "$FILE" --served-model-name m --port "$PORT" > /tmp/bench_served_nanoserve.log 2>&1 &
measure "nanoserve serve" $!
