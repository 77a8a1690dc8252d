#!/usr/bin/env bash
# Every arm at its own tuned rates, selected at the whole horizon: the both-rates studies of 2026-12-07-tuned-adamw-part
# (`muon_lr` and `lr` per Muon arm, `lr` for `adamw`, later passes until no key moves, `min_lr` = lr / 10) again with
# selection runs of the confirmation's length (500 steps; the tuner's default `--tune-fraction 1` since 6fa29a7),
# where those studies selected at 250. `mini` model (4 layers, 4 heads, context 64, data/classics-bpe4k), selection
# seed 1000, confirmation seeds 0, 1, 2. One run at a time (JOBS=2 for two), one torch thread.
# Resumable: rerun a step to continue; `pack`/`unpack` move an unfinished study to another machine.
#
#   lab/2026-12-07-whole-horizon/run.sh [STEP ...]     # from the repository root
#
# Steps (in the order they run by default):
#   w64       n_embd 64: docs/results/tuned-whole-w64
#   w128      n_embd 128 (the main settings): docs/results/tuned-whole-w128
#   w256      n_embd 256, 2,000 steps, the issue's reduced set for a width over ~24 CPU-hours: `unconstrained`,
#             `all-stiefel`, `hetero`, `adamw`, each key on a 3-point grid (c/2, c, 2c) about the arm's choice at
#             width 128 (w128 must have finished selecting), grown at an edge: docs/results/tuned-whole-w256
#   exact128  training's default solver against `exact` on the four constrained presets, `muon_lr` alone (the AdamW
#             part at the shared `lr`), each grid 3+ points about 2026-12-06-tuned-widths' half-horizon choices
#             (docs/results/tuned-exact-w128), grown at an edge: docs/results/tuned-whole-exact-ctx64
#   ctx128    the same at context 128, each grid 3+ points about exact128's choices (exact128 must have finished
#             selecting): docs/results/tuned-whole-exact-ctx128
#   pack | unpack STUDY   a study to or from state/STUDY.tar.xz (runs not done stay out: they start again)
set -euo pipefail
case "${1:-}" in  # --help: the header above, and nothing run
    -h | --help) echo "usage: lab/2026-12-07-whole-horizon/run.sh [STEP ...]"; sed -n '2,/^set /s/^#\( \|$\)//p' "$0"; exit 0 ;;
esac
cd "$(dirname "$0")/../.."
G=${GEOMTRAIN:-.venv/bin/geomtrain}
here=lab/2026-12-07-whole-horizon
both=(--tune muon_lr=0.005,0.01,0.02,0.04,0.08 --tune lr=2.4e-3,4.8e-3,9.6e-3,1.92e-2,3.84e-2 --select-seeds 1
    --tune-max-extend 4 --tune-fraction 1)
constrained=all-stiefel,all-dgram,hetero,hetero-inv
common=(--model mini --set block_size=64 --seeds 3 --jobs "${JOBS:-1}" --threads 1 --data-dir data/classics-bpe4k)
grids_about() {  # study $1, presets $2...: --tune PRESET:KEY=c/2,c,2c about each key's last choice (of every solver)
    python3 - "docs/results/$1/study.json" "${@:2}" <<'PY'
import json, sys
tuning = json.load(open(sys.argv[1]))["tuning"]
if "arms" not in tuning:
    sys.exit(f"{sys.argv[1]}: its selection has not finished; run its step first")
for preset in sys.argv[2:]:
    grids = {}
    for arm, record in tuning["arms"].items():
        if arm.split("+")[0] == preset:
            chosen = {stage["key"]: stage["best"] for stage in record.get("stages", [record])}  # later passes win
            for key, c in chosen.items():
                grids.setdefault(key, set()).update((c / 2, c, 2 * c))
    print(" ".join(f"--tune {preset}:{key}=" + ",".join(f"{v:g}" for v in sorted(vs)) for key, vs in grids.items()))
PY
}
case "${1:-}" in
    pack) "$G" study pack --restart-unfinished "docs/results/$2" "$here/state/$2.tar.xz"; exit 0 ;;  # runs not done: out
    unpack) "$G" study unpack "$here/state/$2.tar.xz" "docs/results/$2"; exit 0 ;;
esac
for s in ${@:-w64 w128 exact128 ctx128 w256}; do case "$s" in
    w64) "$G" study "${common[@]}" --iters 500 "${both[@]}" --set n_embd=64 --out docs/results/tuned-whole-w64 \
        --runs-dir runs/tuned-whole-w64 ;;
    w128) "$G" study "${common[@]}" --iters 500 "${both[@]}" --out docs/results/tuned-whole-w128 --runs-dir runs/tuned-whole-w128 ;;
    w256) grids=$(grids_about tuned-whole-w128 unconstrained all-stiefel hetero adamw)
        # shellcheck disable=SC2086  # the grids are words
        "$G" study "${common[@]}" --iters 2000 $grids --select-seeds 1 --tune-max-extend 4 --tune-fraction 1 \
            --presets adamw,unconstrained,all-stiefel,hetero --set n_embd=256 --out docs/results/tuned-whole-w256 \
            --runs-dir runs/tuned-whole-w256 ;;
    exact128 | ctx128) [ "$s" = exact128 ] && ctx=64 about=tuned-exact-w128 || ctx=128 about=tuned-whole-exact-ctx64
        grids=$(grids_about $about ${constrained//,/ })
        # shellcheck disable=SC2086  # the grids are words
        "$G" study "${common[@]/block_size=64/block_size=$ctx}" --iters 500 $grids --select-seeds 1 --tune-max-extend 4 \
            --tune-fraction 1 --presets "$constrained" --solvers default,exact --reference +exact \
            --out "docs/results/tuned-whole-exact-ctx$ctx" --runs-dir "runs/tuned-whole-exact-ctx$ctx" ;;
    *) echo "unknown step $s; valid: w64 w128 w256 exact128 ctx128, pack STUDY, unpack STUDY" >&2; exit 2 ;;
esac; done
