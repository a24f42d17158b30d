#!/usr/bin/env bash
# The benchmarks on a machine with an NVIDIA GPU (one H200 here), in one go, under 8 minutes:
#   1. install the project's missing dependencies from the wheels in .whl (made by bench/device_prepare.sh);
#   2. make a SmolLM2-135M model with random weights in bfloat16 from .device/smollm2 (config + real tokenizer);
#   3. tests/test_engine_cuda.py, then bench/engine.py: the engine core against plain transformers, 256 requests
#      of 128 + 128 tokens;
#   4. bench/frontend.py: the simulated engine behind 1 and 8 API servers;
#   5. bench/serve.py: end to end, `supervise --model <that model>` under 256 concurrent streams.
# Every figure and log goes to $OUT (flat, at most 8 files); each step has its own timeout and a failed
# step does not stop the next; a summary table ends the output.
#
#   bash bench/device.sh            # on the GPU machine, from the repository root, with .whl and .device carried
#   bash bench/device.sh --cpu      # a tiny run of the same steps on the CPU, to test the script anywhere
set -u
cd "$(dirname "$0")/.."

CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/results/device-$(date +%Y%m%d-%H%M%S)}
BUDGET_S=${BUDGET_S:-470}   # the whole script; each step gets at most what is left
SITE=${SITE:-/tmp/site}
MODEL_DIR=${MODEL_DIR:-/tmp/smollm2-random}
STEPS=$(mktemp /tmp/device-steps.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/supervise-cache}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ "$CPU" = 1 ]; then
  DEVICE=cpu DTYPE=float32
  ENGINE_ARGS="--num-prompts 4 --prompt-len 16 --output-len 8"
  FRONTEND_ARGS="--servers 1 2 --duration 2 --warmup 0.5 --stream-tokens 32 --paced-tokens 16 --client-processes 1"
  SERVE_ARGS="--num-prompts 8 --max-concurrency 4 --input-len 16 --output-len 8"
  SUPERVISE_ARGS="--max-num-seqs 8"
else
  DEVICE=cuda DTYPE=bfloat16
  ENGINE_ARGS="--num-prompts 256 --prompt-len 128 --output-len 128"
  FRONTEND_ARGS="--servers 1 8 --duration 8 --warmup 1 --client-processes 4 --engines 4"
  SERVE_ARGS="--num-prompts 1024 --max-concurrency 256 --input-len 128 --output-len 128 --max-duration 60"
  SUPERVISE_ARGS="--max-num-seqs 256 --max-num-batched-tokens 8192"
fi

# step NAME SECONDS COMMAND...: run it under `timeout`, clamped to the budget left; note its exit code and time.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    echo "== $name: skipped, the budget is spent"; echo "$name skipped 0" >>"$STEPS"; return
  fi
  echo "== $name (at most ${limit}s): $*"
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - started))s"
  echo "$name $rc $((SECONDS - started))" >>"$STEPS"
}

install_wheels() {
  if "$PYTHON" -c "import uvicorn, starlette, zmq, orjson, pydantic, setproctitle, httptools" 2>/dev/null; then
    echo "the dependencies import already"; return 0
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
}
export -f install_wheels
export PYTHON SITE

main() {
  echo "device.sh $(date -Is) on $(hostname): $(nproc) cores, mode $DEVICE/$DTYPE, out $OUT"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  step install 60 bash -c install_wheels
  "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__)"
  step stage-tokenizer 60 "$PYTHON" bench/stage_embedded_model.py .device/smollm2 "$SITE"
  step random-model 90 "$PYTHON" bench/make_random_model.py .device/smollm2 "$MODEL_DIR" --dtype "$DTYPE"
  # The CUDA tests: greedy tokens equal transformers' with and without CUDA graphs (skipped with --cpu).
  [ "$CPU" = 1 ] || step gpu-tests 120 bash -c "set -o pipefail; '$PYTHON' -m pytest -q -p no:cacheprovider \
tests/test_engine_cuda.py | tee '$OUT/gpu-tests.txt'"
  # shellcheck disable=SC2086  # the ARGS variables are word lists on purpose
  step engine 150 bash -c "set -o pipefail; '$PYTHON' bench/engine.py --model '$MODEL_DIR' --device $DEVICE \
--dtype $DTYPE $ENGINE_ARGS | tee '$OUT/engine.txt'"
  # shellcheck disable=SC2086
  step frontend 150 "$PYTHON" bench/frontend.py $FRONTEND_ARGS --result-json "$OUT/frontend.json" \
    --plot "$OUT/frontend.png"
  # shellcheck disable=SC2086
  step serve 150 "$PYTHON" bench/serve.py --start-supervise "--model $MODEL_DIR --device $DEVICE --dtype $DTYPE \
$SUPERVISE_ARGS" --tokenizer "$MODEL_DIR" $SERVE_ARGS --result-json "$OUT/serve.json" --plot "$OUT/serve.png"
  "$PYTHON" bench/device_summary.py "$OUT" "$STEPS" | tee "$OUT/summary.txt"
  rm -f "$STEPS"
  echo "total ${SECONDS}s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

# A pipeline, not `exec > >(tee)`: the script ends only when the log is whole.
main 2>&1 | tee -a "$OUT/device.log"
