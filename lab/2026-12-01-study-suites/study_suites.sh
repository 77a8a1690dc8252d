#!/usr/bin/env bash
# The exact-solver study (docs/results.md, "The study with the exact solver"), one suite per call,
# in pieces: each call trains for at most HOURS (default 2), then stops every run at its next step
# boundary with a checkpoint, as Ctrl-C does. Rerun the same line to continue where it stopped;
# a suite that is complete only rewrites its report. `compare` rebuilds the side-by-side tables.
# A suite longer than a machine is kept moves with `save SUITE` (its study folder and runs, less the
# checkpoints of finished runs, into lab/2026-12-01-study-suites/state/SUITE.tar.xz: commit that, not docs/results/SUITE)
# and `restore SUITE` on the next machine. With SAVE=1 a SUITE line that stops unfinished saves by
# itself, and any SUITE line restores a saved study that the checkout does not hold yet.
#
#   lab/2026-12-01-study-suites/study_suites.sh SUITE [HOURS]
#   lab/2026-12-01-study-suites/study_suites.sh save SUITE | restore SUITE
#
# Suites: main-exact ablation-tangent ablation-published split-qkv lr-exact length-500 length-2000 length-8000
# length-8000-seed1 compare
set -euo pipefail
usage="usage: lab/2026-12-01-study-suites/study_suites.sh SUITE [HOURS] | save SUITE | restore SUITE; SUITE: main-exact, ablation-tangent, ablation-published, split-qkv, lr-exact, length-500, length-2000, length-8000, length-8000-seed1, compare"
case "${1:-}" in  # --help: the usage and the header above, and nothing run
    -h | --help) echo "$usage"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."  # the repository root: every path below is relative to it
suite=${1:?$usage}
hours=${2:-2}
GEOMTRAIN=${GEOMTRAIN:-geomtrain}
case "$suite" in  # every suite's study folder is docs/results/SUITE; its runs folder is in its study.json
    save) mkdir -p lab/2026-12-01-study-suites/state; exec "$GEOMTRAIN" study pack "docs/results/${2:?$usage}" "lab/2026-12-01-study-suites/state/$2.tar.xz" ;;
    restore) exec "$GEOMTRAIN" study unpack "lab/2026-12-01-study-suites/state/${2:?$usage}.tar.xz" "docs/results/$2" ;;
esac
# The committed study's shared settings (docs/results.md): mini, context 64, 16 x 64 tokens per step.
common=(--model mini --set block_size=64 --jobs 2)
presets5=unconstrained,all-stiefel,hetero,all-dgram,hetero-inv
case "$suite" in
    main-exact)
        args=(--seeds 3 --iters 500 --out docs/results/main-exact --runs-dir runs/study-main-exact) ;;
    ablation-tangent)  # the one-shot approximation, with this code (the committed main study ran older code)
        args=(--presets unconstrained,all-stiefel,hetero,all-dgram --seeds 3 --iters 500 --set muon_solver=tangent
              --out docs/results/ablation-tangent --runs-dir runs/study-ablation-tangent) ;;
    ablation-published)  # the paper's dual ascent; float32 msign (its bf16 one is emulated, 5x slower, on a CPU)
        args=(--presets unconstrained,all-stiefel,hetero,all-dgram --seeds 3 --iters 500 --set muon_solver=published
              --set muon_solver_options=msign_dtype=float32
              --out docs/results/ablation-published --runs-dir runs/study-ablation-published) ;;
    split-qkv)
        args=(--presets unconstrained,hetero,hetero-inv --seeds 3 --iters 500 --set split_qkv=true
              --out docs/results/split-qkv --runs-dir runs/study-split-qkv) ;;
    lr-exact)  # shares main-exact's runs folder: its seed-0 runs are the sweep's muon_lr=0.02 point
        args=(--presets "$presets5" --sweep muon_lr=0.005,0.01,0.02,0.05,0.1 --seeds 1 --iters 500
              --out docs/results/lr-exact --runs-dir runs/study-main-exact) ;;
    length-500 | length-2000 | length-8000)
        n=${suite#length-}
        # Shakespeare + KJV + Austen (3.5M train tokens): 8,000 x 1,024 tokens pass over it 2.3 times
        "$GEOMTRAIN" prepare --dataset classics+austen --tokenizer bpe4k
        args=(--presets "$presets5" --seeds 1 --iters "$n" --data-dir data/classics+austen-bpe4k
              --set checkpoint_interval=50 --out "docs/results/length-$n" --runs-dir "runs/study-length-$n") ;;
    length-8000-seed1)  # the pair that decides the 8,000-step ordering, with a second seed; run it at the commit of
        # length-8000 (f96e7a6, one solver for both seeds: see lab/2026-12-01-study-suites/state/README.md)
        "$GEOMTRAIN" prepare --dataset classics+austen --tokenizer bpe4k
        args=(--presets unconstrained,all-dgram --seeds 1, --iters 8000 --data-dir data/classics+austen-bpe4k
              --set checkpoint_interval=50 --out docs/results/length-8000-seed1 --runs-dir runs/study-length-8000-seed1) ;;
    compare)
        cmp() { local out=$1; shift; for s in "$@"; do [ -f "${s#*=}/summary.json" ] || { echo "skip $out: ${s#*=} not run yet"; return 0; }; done
                "$GEOMTRAIN" study compare --out "$out" "$@"; }
        cmp docs/results/compare-solvers exact=docs/results/main-exact tangent=docs/results/ablation-tangent \
            published=docs/results/ablation-published
        cmp docs/results/compare-main tangent=docs/results/main exact=docs/results/main-exact
        cmp docs/results/compare-split-qkv fused=docs/results/main-exact split=docs/results/split-qkv
        cmp docs/results/compare-lr shared=docs/results/main-exact sweep=docs/results/lr-exact
        lengths=()  # the lengths run so far: the comparison grows as the suite proceeds
        for n in 500 2000 8000; do [ -f "docs/results/length-$n/summary.json" ] && lengths+=("steps$n=docs/results/length-$n"); done
        [ ${#lengths[@]} -gt 0 ] && cmp docs/results/compare-length "${lengths[@]}"
        exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
state="lab/2026-12-01-study-suites/state/$suite.tar.xz"
if [ -f "$state" ] && [ ! -f "docs/results/$suite/study.json" ]; then  # a fresh checkout: continue the saved study
    "$GEOMTRAIN" study unpack "$state" "docs/results/$suite"
fi
start=$(date +%s)
setsid "$GEOMTRAIN" study "${common[@]}" "${args[@]}" &
pid=$!
( sleep "${hours}h"; echo "study_suites: ${hours} h are up: stopping (rerun to continue)" >&2; kill -INT -- "-$pid" 2>/dev/null ) &
watcher=$!
code=0
wait "$pid" || code=$?
kill "$watcher" 2>/dev/null || true
echo "study_suites: $suite: exit $code after $(( $(date +%s) - start )) s" >&2
if [ "$code" = 130 ] && [ -n "${SAVE:-}" ]; then  # stopped unfinished: keep it for the next machine
    mkdir -p lab/2026-12-01-study-suites/state && "$GEOMTRAIN" study pack "docs/results/$suite" "$state" \
        && echo "study_suites: saved $state: commit it (not docs/results/$suite) to continue elsewhere" >&2
elif [ "$code" = 0 ] && [ -f "$state" ]; then
    echo "study_suites: $suite is complete: $state is no longer needed (git rm it)" >&2
fi
exit "$code"
