#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks (run from the repo root on the GPU machine).
#   bash tools/gpu_suite.sh decode   # GPU parity (kernels on), transformers peer, decode sweep
#   bash tools/gpu_suite.sh serve    # engine throughput/latency, then the server under load
# Logs and JSON results go to $OUT; the last lines printed are the summaries.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
decode)
  python3 -m pytest -q -p no:cacheprovider tests/test_parity.py > "$OUT/parity.txt" 2>&1
  tail -n 4 "$OUT/parity.txt"
  python3 tools/peer_transformers.py --preset gpt-oss-20b --batch 1,64 --prompt-len 1024 --new-tokens 32 \
    --out "$OUT/peer_transformers.json" > "$OUT/peer.txt" 2>&1
  grep transformers "$OUT/peer.txt"
  python3 tools/bench_decode.py --presets "${PRESETS:-gpt-oss-20b,gpt-oss-120b}" --out "$OUT/decode.json" \
    > "$OUT/decode.txt" 2>&1
  grep -E "TPOT|copy|skipped" "$OUT/decode.txt"
  ;;
serve)
  python3 tools/bench_engine.py --preset gpt-oss-20b --num-requests 256 --out "$OUT/engine_20b.json" \
    > "$OUT/engine.txt" 2>&1
  grep -E "^\[" "$OUT/engine.txt"
  pip install -q --no-index --find-links wheels openai-harmony starlette uvicorn pydantic > /dev/null 2>&1
  python3 tools/make_checkpoint.py --preset gpt-oss-20b --out /tmp/ck20 > /dev/null 2>&1
  TIKTOKEN_ENCODINGS_BASE=wheels python3 -m gptoss_jax.serve --model /tmp/ck20 --port 8000 \
    --config configs/max_throughput.yaml > "$OUT/server.txt" 2>&1 &
  for _ in $(seq 1 150); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health)" = 200 ] && break; sleep 2
  done
  for c in 1 64; do
    n=$([ "$c" = 1 ] && echo 8 || echo 256)
    python3 tools/bench_serving.py --base-url http://127.0.0.1:8000 --concurrency $c --num-prompts $n \
      --input-len 1024 --output-len 256 --json "$OUT/serving_c$c.json" > "$OUT/serving_c$c.txt" 2>&1
    tail -n 12 "$OUT/serving_c$c.txt"
  done
  curl -s http://127.0.0.1:8000/metrics | grep -E "^gptoss_(num_preemptions|requests_total|kv)" | head
  kill %1
  ;;
*) echo "usage: $0 decode|serve" >&2; exit 2 ;;
esac
