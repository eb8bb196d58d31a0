#!/usr/bin/env bash
# The 128 px runs of docs/experiments/generalisation.md's choice on inner folds by event
# (Hurricane Michael held out), on one GPU machine (one call of the lent machine: about 6 minutes
# on an H200 with 16 cores). Run from the project root with the project importable (PYTHONPATH=.):
#
#   local-damage prepare xbd --xbd ../shared/data/xbd_sample --xbd ../shared/data/xbd_extra \
#       --xbd work/data/xbd_michael --out work/all5/chips128 --chip-size 128
#   local-damage split work/all5/chips128 --by event
#   python docs/experiments/generalisation/inner_event_jobs.py plan work/all5/chips128 2 2 IDS
#   (a copy of work/all5/chips128 without the held-out event's tiles: FOUR)
#   python -m data_prep.store_pack pack FOUR PACK
#   bash docs/experiments/generalisation/gpu_inner_event.sh PACK IDS OUT [SECONDS]
#
# The store travels without the held-out event (42 MB packed at JPEG quality 95; the whole store 83 MB, over the 64 MiB upload):
# the inner runs are evaluated here, on the held-out training event; the outer runs are trained
# here and evaluated where the held-out event is. Jobs (inner_event_jobs.py run, P at a time,
# longest first) still running after SECONDS (default 500) are stopped; the finished ones are
# kept. OUT gets results.tar.gz (logs, job list, runs without weights) and the weights of each
# finished outer run in float16, in 15 MB parts.
set -uo pipefail
PACK=${1:?usage: gpu_inner_event.sh PACK IDS OUT [SECONDS]}
IDS=${2:?usage: gpu_inner_event.sh PACK IDS OUT [SECONDS]}
OUT=${3:?usage: gpu_inner_event.sh PACK IDS OUT [SECONDS]}
SECONDS_LEFT=${4:-500}
P=${P:-6}
WORK=${WORK:-/tmp/inner}
mkdir -p "$WORK/logs" "$OUT"
OUT=$(cd "$OUT" && pwd)
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
ROOT=$PWD  # the project root: the weights are packed from $WORK
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
python -m data_prep.store_pack unpack "$PACK" "$WORK/chips" >/dev/null || exit 1
OUTER=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['outer_fold'])" "$IDS") || exit 1
SETS=${SETS:-"--set train.amp=bf16 --set data.num_workers=2"}
# name | config | job (an inner fold, or outer); longest first (JOBS_FILE: another list)
[[ -n ${JOBS_FILE:-} ]] && cp "$JOBS_FILE" "$WORK/jobs.txt"
[[ -n ${JOBS_FILE:-} ]] || cat > "$WORK/jobs.txt" <<JOBS
general-long-128|configs/cpu-local-general-long-128.yaml|outer
general-long-128|configs/cpu-local-general-long-128.yaml|1
general-128|configs/cpu-local-general-128.yaml|outer
general-128|configs/cpu-local-general-128.yaml|1
general-long-128|configs/cpu-local-general-long-128.yaml|0
general-128|configs/cpu-local-general-128.yaml|0
JOBS
job() {
    IFS='|' read -r name config j <<<"$1"
    local run="$WORK/runs/inner-event/outer$OUTER/$name/fold$j"
    [[ $j == outer ]] && run="$WORK/runs/$name/fold$OUTER"
    local start=$(date +%s)
    python docs/experiments/generalisation/inner_event_jobs.py run "$config" "$WORK/chips" "$IDS" \
        "$j" "$run" $SETS >"$WORK/logs/$name-$j.log" 2>&1
    echo "$name $j: exit $? after $(( $(date +%s) - start )) s" >>"$WORK/logs/jobs.log"
}
export -f job
export WORK IDS OUTER SETS
date +%s >"$WORK/start"
timeout --signal=TERM "$SECONDS_LEFT" xargs -a "$WORK/jobs.txt" -d '\n' -P "$P" -I{} bash -c 'job "$@"' _ {}
echo "jobs ended after $(( $(date +%s) - $(cat "$WORK/start") )) s"
cat "$WORK/logs/jobs.log"
nvidia-smi --query-gpu=name,memory.used --format=csv >"$WORK/logs/gpu.txt" 2>&1
cd "$WORK" || exit 1
tar czf "$OUT/results.tar.gz" --exclude='*.safetensors' --exclude='checkpoints' --exclude='*.png' \
    --exclude='*.pt' --exclude='embeddings.npz' logs jobs.txt runs
for run in runs/*/fold"$OUTER"; do
    [ -f "$run/best.safetensors" ] || continue
    python "$ROOT/docs/experiments/generalisation/half_weights.py" pack "$run" \
        "$OUT/$(echo "$run" | tr / _).half.safetensors"
done
ls -la "$OUT"
