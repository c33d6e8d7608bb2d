#!/usr/bin/env bash
# The GPU benchmark runs, in sets that each fit one device call (600 s), results under $OUT.
#
#   bash bench/gpu_runs.sh confirm|batch|backlog|ab|offers|suite SHA
#
# Run on the device from the snapshot (see bench/README.md "How to run"): call 1 carries .gpu-a, call 2
# `source .gpu-b/device-setup.sh >/dev/null 2>&1 && cd .bench-src && bash bench/gpu_runs.sh batch SHA`.
# - confirm (~300 s): the figures a session checks first, in one call: batch_generate greedy at 64
#   jobs, REPEATS times in turns with mlx-lm (default 5: issue 9's target), then `python3 -m bench`'s
#   scoring and warm cache (issue 5's open ones), and bench.tokenize_probe on all cores and on one;
# - batch (~400-500 s): batch_generate greedy at 1/8/32/64 jobs, sampled (temperature 0.8, top-p 0.95)
#   and staggered at 64, each REPEATS times in turns (default 3); then bench.batch_step (one decode step
#   split between device syncs);
# - backlog (~150-250 s): 256 staggered jobs through 64 rows, with MLXQ_BATCH_MIN_JOIN 1 and 8, once
#   each unless REPEATS says otherwise;
# - suite (~560 s): `python3 -m bench` on the 1B shape (issue 5's figures);
# - ab (~450 s): AB=MLXQ_...=VALUE[,...] (required): a second batched worker with those settings, run in
#   turns with the default one (and mlx-lm, and the in-process engine, also that way for
#   MLXQ_DECODE_OVERLAP): greedy and staggered at 64 jobs, REPEATS times; the 256-job backlog once;
# - offers (~300 s): what a prefix-cache offer costs on the device (bench.offer_probe, a full cache of
#   250 leaves as the workers' gets), then 64 jobs and the backlog with the prefix cache off in turns
#   with it on (what it still costs a batch of prompts that share nothing).
# Each run has its own timeout, so one that hangs cannot take the others' time; a summary of the tables
# is printed at the end.
set -u
set_name=${1:?confirm, batch, backlog, ab, offers or suite}
sha=${2:?the commit the snapshot was made from}
out=${OUT:?OUT: the folder the device tool brings back}
model=${MODEL:-llama-1b}  # MODEL=tiny: a quick check of this script on a CPU
export MLXQ_BENCH_COMMIT=$sha
bg=(python3 -m bench.batch_generate --model "$model" --batch 64 --max-tokens 128 --prompt-words 48 --no-alone --out "$out"
    --repeats "${REPEATS:-3}")

run() {  # run SECONDS LOG COMMAND...: one run, its output in $out/LOG
    local seconds=$1 log=$2
    shift 2
    echo "== $log: $*" >&2
    timeout "$seconds" "$@" >"$out/$log" 2>&1 || echo "!! $log: exit $?" >&2
}

python3 -c "from bench.checkpoints import checkpoint; from pathlib import Path; \
checkpoint('$model', Path.home() / '.cache/mlxq/bench-models')"
case $set_name in
confirm)
    run 250 confirm-greedy.log "${bg[@]}" --repeats "${REPEATS:-5}" --sizes 64 --label "gpu-bg-confirm-$sha"
    run 300 confirm-issue5.log python3 -m bench --model "$model" --sizes gpu --out "$out" \
        --label "gpu-llama-1b-confirm-$sha" --only scoring,warm_cache
    run 60 tokenize.log python3 -m bench.tokenize_probe --repeats 40
    run 60 tokenize-1-core.log env RAYON_NUM_THREADS=1 python3 -m bench.tokenize_probe --repeats 40
    ;;
batch)
    run 220 greedy.log "${bg[@]}" --sizes 1,8,32,64 --label "gpu-bg-$sha"
    run 110 sampled.log "${bg[@]}" --sizes 64 --temperature 0.8 --top-p 0.95 --label "gpu-bg-sampled-$sha"
    run 110 staggered.log "${bg[@]}" --sizes 64 --staggered --label "gpu-bg-staggered-$sha"
    run 100 step.log python3 -m bench.batch_step --model "$model" --rows 64 --steps 64
    ;;
backlog)
    run 170 backlog-join1.log "${bg[@]}" --repeats "${REPEATS:-1}" --sizes 256 --staggered --label "gpu-bg-backlog-$sha"
    MLXQ_BATCH_MIN_JOIN=8 run 170 backlog-join8.log "${bg[@]}" --repeats "${REPEATS:-1}" --sizes 256 --staggered \
        --label "gpu-bg-backlog-minjoin8-$sha"
    ;;
ab)
    ab=${AB:?AB: the settings of the second batched worker, e.g. MLXQ_DECODE_OVERLAP=false}
    run 170 ab-greedy.log "${bg[@]}" --sizes 64 --ab-env "$ab" --label "gpu-ab-$sha"
    run 150 ab-staggered.log "${bg[@]}" --sizes 64 --staggered --ab-env "$ab" --label "gpu-ab-staggered-$sha"
    run 150 ab-backlog.log "${bg[@]}" --repeats 1 --sizes 256 --staggered --ab-env "$ab" --no-inproc \
        --label "gpu-ab-backlog-$sha"
    ;;
offers)
    run 120 offer-probe.log python3 -m bench.offer_probe --model "$model" --rows 400 --tokens 128 --full-rows 250
    run 130 offers-greedy.log "${bg[@]}" --sizes 64 --no-inproc --ab-env MLXQ_PREFIX_CACHE_BYTES=0 \
        --label "gpu-ab-nocache-$sha"
    run 150 offers-backlog.log "${bg[@]}" --repeats 1 --sizes 256 --staggered --no-inproc \
        --ab-env MLXQ_PREFIX_CACHE_BYTES=0 --label "gpu-ab-nocache-backlog-$sha"
    ;;
suite)
    run 560 suite.log python3 -m bench --model "$model" --sizes gpu --out "$out" --label "gpu-llama-1b-$sha" \
        --only generation,diagnostics,prefill,scoring,warm_cache,queue
    ;;
*)
    echo "unknown set: $set_name (confirm, batch, backlog, ab, offers or suite)" >&2
    exit 2
    ;;
esac
# The tables (the runs' .md files; batch_step prints only to its log), for the call's output tail.
grep -hE '^\| (queue|engine|mlx|hand|DecodeBatch|graph|one block|one copy|no copy|batch calls|one call|[0-9.]+ \|)|MISSED|met \||cores, RAYON' \
    "$out"/*.md "$out"/step.log "$out"/offer-probe.log "$out"/tokenize*.log 2>/dev/null | head -90
