#!/usr/bin/env bash
# The training runs of docs/experiments/generalisation.md, on one GPU machine (one call of the
# lent machine: about 8 minutes on an H200 with 16 cores). Run from the project root with the
# project importable (PYTHONPATH=.) and a packed 64 px store of every labelled tile:
#
#   local-damage prepare xbd --xbd ../shared/data/xbd_sample --xbd ../shared/data/xbd_extra \
#       --xbd work/data/xbd_michael --out work/all5/chips64 --chip-size 64
#   python -m data_prep.store_pack pack work/all5/chips64 PACK
#   bash docs/experiments/generalisation/gpu_jobs.sh PACK OUT [SECONDS]
#
# It unpacks the store twice (spatial blocks: `split --by block --stratify event --seed 14`;
# events: `split --by event`), runs the jobs below P at a time (each `local-damage cv` of one
# fold, then its training-set figures and embeddings), trains the shipped recipe on every tile,
# and packs what came out into OUT (results.tar.gz; the weights of the final model and of the
# bundled recipe's model trained without Hurricane Michael, in 15 MB parts). Jobs still running
# after SECONDS (default 450) are stopped; the finished ones are kept.
set -uo pipefail
PACK=${1:?usage: gpu_jobs.sh PACK OUT [SECONDS]}
OUT=${2:?usage: gpu_jobs.sh PACK OUT [SECONDS]}
SECONDS_LEFT=${3:-450}
P=${P:-5}
WORK=${WORK:-/tmp/gen}
mkdir -p "$WORK" "$OUT"
OUT=$(cd "$OUT" && pwd)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
ROOT=$PWD  # the project root: the weights are packed from $WORK
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
LD="python -m cli.main"
python -m data_prep.store_pack unpack "$PACK" "$WORK/block" >/dev/null || exit 1
cp -r "$WORK/block" "$WORK/event"
$LD split "$WORK/block" --by block --folds 5 --stratify event --seed 14 --quiet || exit 1
$LD split "$WORK/event" --by event --quiet || exit 1
GPU=${GPU:-"--set train.device=cuda --set data.num_workers=2"}
# name | config | store | fold ; event folds: 0 guatemala, 1 florence, 2 michael, 3 joplin, 4 santa-rosa
cat > "$WORK/jobs.txt" <<JOBS
final|configs/cpu-local-general.yaml|block|-
loeo-general|configs/cpu-local-general.yaml|event|2
loeo-bundled|configs/cpu-local.yaml|event|2
block-general|configs/cpu-local-general.yaml|block|0
block-general|configs/cpu-local-general.yaml|block|1
block-general|configs/cpu-local-general.yaml|block|2
block-general|configs/cpu-local-general.yaml|block|3
block-general|configs/cpu-local-general.yaml|block|4
loeo-general|configs/cpu-local-general.yaml|event|4
loeo-general|configs/cpu-local-general.yaml|event|3
loeo-general|configs/cpu-local-general.yaml|event|1
block-bundled|configs/cpu-local.yaml|block|0
block-bundled|configs/cpu-local.yaml|block|1
block-bundled|configs/cpu-local.yaml|block|2
block-bundled|configs/cpu-local.yaml|block|3
block-bundled|configs/cpu-local.yaml|block|4
JOBS
job() {
    IFS='|' read -r name config store fold <<<"$1"
    local log="$WORK/logs/$name-$fold.log"
    mkdir -p "$WORK/logs"
    local sets="$GPU"
    # the bundled recipe for 30 epochs, as it was measured on these data before
    [[ $config == configs/cpu-local.yaml ]] && sets="$sets --set train.epochs=30"
    sets="$sets ${EXTRA:-}"
    if [[ $fold == - ]]; then
        $LD train --config "$config" --chips "$WORK/$store" --out "$WORK/runs/$name" $sets --quiet >"$log" 2>&1
        return
    fi
    $LD cv --config "$config" --chips "$WORK/$store" --out "$WORK/runs/$name" --name "$name" \
        --folds "$fold" --views 1 --quiet $sets >"$log" 2>&1 &&
        python -m local_damage.experiments.fold_extras "$WORK/runs/$name/$name/fold$fold" \
            "$WORK/$store" "$fold" >>"$log" 2>&1
}
export -f job
export WORK GPU LD EXTRA
date +%s >"$WORK/start"
timeout --signal=TERM "$SECONDS_LEFT" xargs -a "$WORK/jobs.txt" -d '\n' -P "$P" -I{} bash -c 'job "$@"' _ {}
echo "jobs ended after $(( $(date +%s) - $(cat "$WORK/start") )) s"
nvidia-smi --query-gpu=name,memory.used --format=csv >"$WORK/logs/gpu.txt" 2>&1
cd "$WORK" || exit 1
tar czf "$OUT/results.tar.gz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.png' --exclude='*.pt' \
    logs jobs.txt runs block/splits.csv event/splits.csv
for run in runs/final runs/loeo-bundled/loeo-bundled/fold2; do
    [ -f "$run/best.safetensors" ] || continue
    # float16 halves the upload back (48 -> 24 MB); the model is exported to int8 after anyway
    python "$ROOT/docs/experiments/generalisation/half_weights.py" pack "$run" \
        "$OUT/$(echo "$run" | tr / _).half.safetensors"
done
ls -la "$OUT"
