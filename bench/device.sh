#!/usr/bin/env bash
# The benchmarks on a machine with an NVIDIA GPU (one H200 here), in one go, under 8 minutes:
#   1. install the project's missing dependencies from the wheels in .whl (made by bench/device_prepare.sh);
#   2. tests/test_engine_cuda.py, then bench/engine.py: the engine core against plain transformers, 256 requests
#      of 128 + 128 tokens, on three shapes with random weights built on the GPU (--load-format dummy):
#      SmolLM2-135M (.device/smollm2: config + real tokenizer), Llama-3.2-1B and Llama-3.1-8B (bench/models:
#      their published config.json, a synthetic tokenizer made for their vocabulary); for the 135M shape also
#      the engine alone under serve's closed loop (1024 requests, 256 in flight), with CUDA graphs for steps with
#      prompt tokens and without (--cuda-graph-max-tokens 0);
#   3. bench/step_profile.py: where a decode step of 256 sequences goes (host phases, GPU time, GPU idle);
#   4. bench/frontend.py: the simulated engine behind 1 and 8 API servers;
#   5. bench/serve.py: end to end, `supervise --model <shape> --load-format dummy` under 256 concurrent streams
#      (the 135M shape with 1, 4 and 8 API servers, the one server again with --no-direct-stream-events
#      --no-write-batching, and once more profiled with py-spy);
#   6. bench/tokenizing.py: what a new prompt's tokens cost this machine's CPU, with the word cache and without;
#   7. bench/attention.py: one layer's attention by each kernel of varlen steps (gather + flash, paged Triton).
# The summary gives engine and end-to-end rates as a share of each shape's roofline (bench/roofline.py).
# Every figure and log goes to $OUT (flat); each step has its own timeout and a failed
# step does not stop the next; a summary table ends the output.
#
#   bash bench/device.sh            # on the GPU machine, from the repository root, with .whl and .device carried
#   PYTHON=.venv/bin/python bash bench/device.sh --cpu   # a tiny run of the same steps on the CPU, to test the
#                                   # script anywhere (.whl's wheels are for the GPU machine's Python: use a venv)
set -u
cd "$(dirname "$0")/.."

CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/results/device-$(date +%Y%m%d-%H%M%S)}
# The whole script; each step gets at most what is left. --cpu is a smoke test of the script on a small (and often
# shared) machine, not a measurement: it gets three times each step's time and 20 minutes in all.
BUDGET_S=${BUDGET_S:-$([ "$CPU" = 1 ] && echo 1200 || echo 470)}
SCALE=$([ "$CPU" = 1 ] && echo 3 || echo 1)
SITE=${SITE:-/tmp/site}
MODEL_DIR=${MODEL_DIR:-.device/smollm2}  # config and tokenizer; the weights are --load-format dummy's
if [ ! -f "$MODEL_DIR/config.json" ]; then  # every step but the 1B and 8B shapes needs it: stop before the budget runs
  echo "device.sh: no $MODEL_DIR/config.json: run 'bash bench/device_prepare.sh' first (and carry .whl and .device)" >&2
  exit 2
fi
STEPS=$(mktemp /tmp/device-steps.XXXXXX)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/supervise-cache}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"  # py-spy, from the wheels

if [ "$CPU" = 1 ]; then
  DEVICE=cpu DTYPE=float32
  ENGINE_ARGS="--num-prompts 4 --prompt-len 16 --output-len 8"
  FRONTEND_ARGS="--servers 1 2 --duration 2 --warmup 0.5 --stream-tokens 32 --paced-tokens 16 --client-processes 1"
  SERVE_ARGS="--num-prompts 8 --max-concurrency 4 --input-len 16 --output-len 8"
  CLOSED_LOOP_ARGS="--closed-loop 8"
  SUPERVISE_ARGS="--max-num-seqs 8"
  # The real shapes: the 1B only (the 8B is 32 GB in float32), a few tokens (about 1 s a step on 2 cores).
  SHAPES="llama-3.2-1b"
  PROFILE_ARGS="--num-seqs 8 --prompt-len 16 --steps 5"
  SHAPE_ENGINE_ARGS="--num-prompts 2 --prompt-len 8 --output-len 4 --no-single"
  SHAPE_SERVE_ARGS="--num-prompts 4 --max-concurrency 2 --input-len 8 --output-len 4 --warmup 0"
  SHAPE_SUPERVISE_ARGS="--max-num-seqs 2 --max-model-len 64"
  HARDWARE="--bandwidth-tbps 0.02 --peak-tflops 0.15"  # roughly this 2-core VM in float32: the rows are a smoke test
  ATTENTION_ARGS="--cpu --shapes smollm2-135m"
else
  DEVICE=cuda DTYPE=bfloat16
  ENGINE_ARGS="--num-prompts 256 --prompt-len 128 --output-len 128"
  FRONTEND_ARGS="--servers 1 8 --duration 6 --warmup 1 --client-processes 4 --engines 4"
  SERVE_ARGS="--num-prompts 1024 --max-concurrency 256 --input-len 128 --output-len 128 --max-duration 60"
  CLOSED_LOOP_ARGS="--closed-loop 1024"  # the engine alone under serve's closed loop, for the summary
  SUPERVISE_ARGS="--max-num-seqs 256 --max-num-batched-tokens 8192 --log-stats-interval 2"
  ATTENTION_ARGS=""
  SHAPES="llama-3.2-1b llama-3.1-8b"
  PROFILE_ARGS="--num-seqs 256 --prompt-len 128 --steps 50"
  SHAPE_ENGINE_ARGS="$ENGINE_ARGS --no-single"
  SHAPE_SERVE_ARGS="--num-prompts 512 --max-concurrency 256 --input-len 128 --output-len 128 --max-duration 40"
  SHAPE_SUPERVISE_ARGS="$SUPERVISE_ARGS --max-model-len 2048"
  HARDWARE=""  # bench/device_summary.py's defaults: one H200
fi

# step NAME SECONDS COMMAND...: run it under `timeout`, clamped to the budget left; note its exit code and time.
step() {
  local name=$1 limit=$(($2 * SCALE)); shift 2
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
  if "$PYTHON" -c "import atomicshm, uvicorn, starlette, zmq, orjson, pydantic, setproctitle, httptools, jinja2" 2>/dev/null; then
    echo "the dependencies import already"; return 0
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
}
export -f install_wheels
export PYTHON SITE

# engine_step NAME MODEL SECONDS ARGS...: bench/engine.py on MODEL (random weights), its table in $OUT/NAME.txt.
engine_step() {
  local name=$1 model=$2 limit=$3; shift 3
  step "$name" "$limit" bash -c "set -o pipefail; '$PYTHON' bench/engine.py --model '$model' --load-format dummy \
--device $DEVICE --dtype $DTYPE $* | tee '$OUT/$name.txt'"
}

# profile_step NAME MODEL on|off [ARGS...]: bench/step_profile.py with asynchronous scheduling on or off.
profile_step() {
  local name=$1 model=$2 async=$3; shift 3
  step "$name" 60 bash -c "set -o pipefail; '$PYTHON' bench/step_profile.py --model '$model' --load-format dummy \
--device $DEVICE --dtype $DTYPE --async-scheduling $async $PROFILE_ARGS $* | tee '$OUT/$name.txt'"
}

# serve_step NAME MODEL SECONDS SUPERVISE_ARGS SERVE_ARGS...: end to end, `supervise` under bench/serve.py.
serve_step() {
  local name=$1 model=$2 limit=$3 supervise_args=$4; shift 4
  step "$name" "$limit" "$PYTHON" bench/serve.py --start-supervise "--model $model --load-format dummy \
--device $DEVICE --dtype $DTYPE $supervise_args" --tokenizer "$model" "$@" --result-json "$OUT/$name.json"
}

main() {
  echo "device.sh $(date -Is) on $(hostname): $(nproc) cores, mode $DEVICE/$DTYPE, out $OUT"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  step install 60 bash -c install_wheels
  "$PYTHON" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__)"
  step stage-tokenizer 60 "$PYTHON" bench/stage_embedded_model.py "$MODEL_DIR" "$SITE"
  # The CUDA tests: greedy tokens equal transformers' with and without CUDA graphs, either attention kernel; the
  # paged attention and the fused RoPE kernels compiled (skipped with --cpu).
  [ "$CPU" = 1 ] || step gpu-tests 130 bash -c "set -o pipefail; '$PYTHON' -m pytest -q -p no:cacheprovider \
tests/test_engine_cuda.py tests/test_paged_triton.py tests/test_rope_triton.py | tee '$OUT/gpu-tests.txt'"
  # Budgets: about 470 s in all on the H200; a step that overruns only shortens the ones after it, so the steps
  # run in the order of what the targets need: the 135M shape's engine and end to end with 1 and 4 API servers,
  # the 8B's engine and end to end, the front end alone, the step split; then the variants and the rest.
  # shellcheck disable=SC2086
  engine_step engine "$MODEL_DIR" 100 $ENGINE_ARGS $CLOSED_LOOP_ARGS
  serve_step serve "$MODEL_DIR" 100 "$SUPERVISE_ARGS" $SERVE_ARGS
  [ "$CPU" = 1 ] || serve_step serve-4-servers "$MODEL_DIR" 80 "$SUPERVISE_ARGS --api-server-count 4" $SERVE_ARGS
  for shape in $SHAPES; do
    [ "$shape" = llama-3.1-8b ] || continue
    engine_step "engine-$shape" "bench/models/$shape" 90 $SHAPE_ENGINE_ARGS
    serve_step "serve-$shape" "bench/models/$shape" 90 "$SHAPE_SUPERVISE_ARGS" $SHAPE_SERVE_ARGS
  done
  # shellcheck disable=SC2086
  step frontend 100 "$PYTHON" bench/frontend.py $FRONTEND_ARGS --result-json "$OUT/frontend.json" \
    --plot "$OUT/frontend.png"
  # Where a decode step of 256 sequences goes: host phases, GPU time, GPU idle (with async scheduling, also the 15
  # costliest GPU operations: what the fused RoPE and the paged kernel left); asynchronous scheduling on and off.
  profile_step profile "$MODEL_DIR" on --kernels 15
  profile_step profile-sync "$MODEL_DIR" off
  # The same with every event through the app's send and each socket write made at once (no batch per loop pass):
  # what the two gain the one server.
  serve_step serve-through-send "$MODEL_DIR" 60 "$SUPERVISE_ARGS --no-direct-stream-events --no-write-batching" \
    $SERVE_ARGS
  # 8 API servers, as operators run it: if this one reaches the engine's closed loop where 1 and 4 do not, the gap is
  # the API servers' intake of each wave of new requests.
  [ "$CPU" = 1 ] || serve_step serve-8-servers "$MODEL_DIR" 80 "$SUPERVISE_ARGS --api-server-count 8" $SERVE_ARGS
  # With a py-spy profile of its one API server: where the one-server gap goes (the table at the end of serve's
  # output). A run of its own: py-spy stops the process to sample it, which costs it CPU the figures above must not carry.
  serve_step serve-profiled "$MODEL_DIR" 60 "$SUPERVISE_ARGS" $SERVE_ARGS --profile-api-server "$OUT/serve-profile.txt"
  # One layer's attention by each kernel (gather + flash, paged Triton) on each shape's heads.
  step attention 60 bash -c "set -o pipefail; '$PYTHON' bench/attention.py $ATTENTION_ARGS \
--result-json '$OUT/attention.json' | tee '$OUT/attention.txt'"
  # The closed loop again with graphs for decode-only steps only: what the graphs of steps with prompt tokens gain.
  [ "$CPU" = 1 ] || engine_step loop-decode-graphs-only "$MODEL_DIR" 60 $ENGINE_ARGS $CLOSED_LOOP_ARGS \
    --cuda-graph-max-tokens 0 --no-hf --no-single
  for shape in $SHAPES; do
    [ "$shape" != llama-3.1-8b ] || continue
    engine_step "engine-$shape" "bench/models/$shape" 90 $SHAPE_ENGINE_ARGS
    serve_step "serve-$shape" "bench/models/$shape" 90 "$SHAPE_SUPERVISE_ARGS" $SHAPE_SERVE_ARGS
  done
  # With the 15 costliest GPU operations of a step (torch.profiler): where the 8B's GPU-bound step goes.
  [ "$CPU" = 1 ] || profile_step profile-llama-3.1-8b bench/models/llama-3.1-8b on --kernels 15
  # The same step with gather + flash for every step: what the choice of kernel changes in a whole step.
  [ "$CPU" = 1 ] || profile_step profile-llama-3.1-8b-flash bench/models/llama-3.1-8b on --attention-backend flash
  # This machine's CPU on a new request's tokens: the word cache against the tokenizer, a wave of 256 chats.
  step tokenizing 40 bash -c "set -o pipefail; '$PYTHON' bench/tokenizing.py --tokenizer '$MODEL_DIR' --words 128 \
--prompts 300 | tee '$OUT/tokenizing.txt'"
  # shellcheck disable=SC2086
  "$PYTHON" bench/device_summary.py "$OUT" "$STEPS" $HARDWARE | tee "$OUT/summary.txt"
  rm -f "$STEPS"
  echo "total ${SECONDS}s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

# A pipeline, not `exec > >(tee)`: the script ends only when the log is whole.
main 2>&1 | tee -a "$OUT/device.log"
