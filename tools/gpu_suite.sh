#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks (run from the repo root on the GPU machine).
#   bash tools/gpu_suite.sh parity   # GPU parity with the kernels on, and the transformers peer
#   bash tools/gpu_suite.sh perf     # 20b decode sweep, then everything `serve` does, then the engine latency job
#   bash tools/gpu_suite.sh serve    # the server under load (20b), the 120b decode points
#   bash tools/gpu_suite.sh profile  # where the decode step's time goes (traces; XLA flag variants)
#   bash tools/gpu_suite.sh sweep    # decode sweep of both models (1k / 8k context), batch-1 profile, GPU parity
#   bash tools/gpu_suite.sh throughput gpt-oss-20b   # offline 1k/1k and 8k/1k jobs + batch-1 latency
# Logs and JSON results go to $OUT; the lines printed are the summaries.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "${1:-}" in
parity)
  python3 -m pytest -q -p no:cacheprovider tests/test_parity.py > "$OUT/parity.txt" 2>&1
  tail -n 4 "$OUT/parity.txt"
  python3 -m tools.peer_transformers --preset gpt-oss-20b --batch 1,64 --prompt-len 1024 --new-tokens 32 \
    --out "$OUT/peer_transformers.json" > "$OUT/peer.txt" 2>&1
  grep transformers "$OUT/peer.txt"
  ;;
perf)
  python3 -m tools.bench_decode --presets gpt-oss-20b --batches 1,16,64,256 --reference "" \
    --out "$OUT/decode_20b.json" > "$OUT/decode_20b.txt" 2>&1
  grep -hE "TPOT|copy|skipped|Error" "$OUT"/decode_20b.txt
  ;&
serve)
  python3 -m pip install -q --no-index --find-links wheels openai-harmony starlette uvicorn pydantic 2>&1 | tail -2
  python3 -m tools.make_checkpoint --preset gpt-oss-20b --out /tmp/ck20 > /dev/null 2>&1
  TIKTOKEN_ENCODINGS_BASE=wheels python3 -m gptoss_jax.serve --model /tmp/ck20 --port 8000 \
    --config configs/max_throughput.yaml > "$OUT/server.txt" 2>&1 &
  for _ in $(seq 1 150); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health)" = 200 ] && break; sleep 2
  done
  for c in 1 64; do
    n=$([ "$c" = 1 ] && echo 4 || echo 128)
    python3 -m tools.bench_serving --base-url http://127.0.0.1:8000 --concurrency $c --num-prompts $n \
      --input-len 1024 --output-len 128 --json "$OUT/serving_c$c.json" > "$OUT/serving_c$c.txt" 2>&1
    tail -n 14 "$OUT/serving_c$c.txt"
  done
  kill %1; wait
  python3 -m tools.bench_decode --presets gpt-oss-120b --batches 1,64 --reference "" \
    --out "$OUT/decode_120b.json" > "$OUT/decode_120b.txt" 2>&1
  grep -hE "TPOT|copy|skipped|Error" "$OUT"/decode_120b.txt
  [ "${1}" = serve ] && exit 0
  python3 -m tools.bench_throughput --preset gpt-oss-20b --skip throughput --out "$OUT/engine_latency_20b.json" \
    > "$OUT/engine.txt" 2>&1
  grep -E "^\[|Error" "$OUT/engine.txt"
  ;;
profile)
  timeout 240 python3 -m tools.profile_decode --batch 1,64 --out "$OUT/prof_base.json" > "$OUT/prof_base.txt" 2>&1
  grep -hE "^\[|events/token|Error" "$OUT/prof_base.txt"
  timeout 150 python3 -m tools.bench_decode --presets gpt-oss-120b --batches 1,64 --contexts 1024 --reference "" \
    --out "$OUT/decode_120b.json" > "$OUT/decode_120b.txt" 2>&1
  grep -hE "TPOT|copy|skipped|Error" "$OUT/decode_120b.txt"
  XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL timeout 120 python3 -m tools.profile_decode --batch 1 \
    --label cmdbuf --out "$OUT/prof_cmdbuf.json" > "$OUT/prof_cmdbuf.txt" 2>&1
  grep -hE "^\[|Error" "$OUT/prof_cmdbuf.txt"
  XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 80 python3 -m tools.profile_decode --batch 1 --label dsf \
    --out "$OUT/prof_dsf.json" > "$OUT/prof_dsf.txt" 2>&1
  grep -hE "^\[|events/token|Error" "$OUT/prof_dsf.txt"
  ;;
sweep)
  timeout 330 python3 -m tools.bench_decode --presets gpt-oss-20b,gpt-oss-120b --reference 1,64 \
    --out "$OUT/decode_sweep.json" > "$OUT/decode_sweep.txt" 2>&1
  grep -hE "TPOT|copy|skipped|Error" "$OUT/decode_sweep.txt"
  timeout 60 python3 -m tools.profile_decode --batch 1 --out "$OUT/profile_b1.json" > "$OUT/profile_b1.txt" 2>&1
  grep -hE "^\[|events/token|Error" "$OUT/profile_b1.txt"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_parity.py > "$OUT/parity.txt" 2>&1
  tail -n 3 "$OUT/parity.txt"
  ;;
throughput)
  python3 -m tools.bench_throughput --preset "${2:-gpt-oss-20b}" --out "$OUT/throughput_${2:-gpt-oss-20b}.json" \
    > "$OUT/throughput.txt" 2>&1
  grep -E "^\[|Error|random" "$OUT/throughput.txt"
  ;;
*) echo "usage: $0 parity|perf|serve|profile|sweep|throughput [preset]" >&2; exit 2 ;;
esac
