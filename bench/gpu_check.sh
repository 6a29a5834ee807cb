#!/usr/bin/env bash
# Issue 35's GPU checks in one run: tests/device/test_cuda.py, then the ckptbench commands of
# docs/BENCHMARKS.md "A state on the GPU", then one JSON of every figure and target
# (bench/gpu_summary.py) and the log, both under $OUT (what the device tool brings back).
#
# On the device machine (its python3 holds torch; make gpu-wheels first, here, and carry .whl):
#     bash bench/gpu_check.sh                      # every part
#     PARTS="loop save" bash bench/gpu_check.sh    # some, in order: test save first reserved restore loop
#     PARTS="recover recover_dcp" bash bench/gpu_check.sh   # issue 36's tiered restore, on its cores
#     SAVE_METHODS=ckptstore,dcp_async RESTORE_METHODS=ckptstore,ckptstore_host,dcp REPEAT=2 ...
# Rehearsed on a CPU (the cpu as the "device", small sizes):
#     DEVICE=cpu SIZE=128MiB LOOP_SIZE=32MiB LOOP_STEPS=80 OUT=/tmp/gpu PY=.venv/bin/python \
#         WHEELS=none bash bench/gpu_check.sh
# Each part has a time limit (LIMIT_S, default 240 s; LIMIT_<part>, e.g. LIMIT_save, for one);
# a part that fails or runs past it is recorded as such and the next one runs. A machine's start
# can cost minutes of the device time, so fit every part in one call (600 s at most) with
# per-part limits and SIZE=4GiB (docs/BENCHMARKS.md "A state on the GPU"). The summary is
# rewritten after every part. On a cpu the loop part runs the cpu step kinds, not the GPU
# training loop: its target reads null.
set -u
case "${1:-}" in
-h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
?*) echo "bench/gpu_check.sh takes no arguments (settings are variables: see --help)" >&2; exit 2 ;;
esac
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-8GiB}
LOOP_SIZE=${LOOP_SIZE:-1GiB}
LOOP_STEPS=${LOOP_STEPS:-400}
ALL_PARTS="test save first reserved restore loop recover recover_dcp"
PARTS=${PARTS:-test save first reserved restore loop}
RECOVER_SIZE=${RECOVER_SIZE:-1GiB}
LIMIT_S=${LIMIT_S:-240}
REPEAT=${REPEAT:-3}
PY=${PY:-python3}
FIRST_METHODS=ckptstore,ckptstore_host  # device staging beside pinned host staging
[ "$DEVICE" = cpu ] && FIRST_METHODS=ckptstore  # no host staging to compare with on a cpu
OUT=${OUT:-/tmp/gpu-check}
WORK=$(mktemp -d /tmp/gpu-check-work.XXXXXX)
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"

WHEELS=${WHEELS:-.whl}  # the wheels brought along (make gpu-wheels); WHEELS=none: use what is there
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site "$WHEELS"/*.whl >>"$LOG" 2>&1 || { echo "wheels did not install" | tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/gpu-check-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

"$PY" - >>"$LOG" 2>&1 <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
EOF
nvidia-smi -L >>"$LOG" 2>&1 || true

part() {  # part NAME COMMAND...: the command's stdout into $WORK/NAME.json, its rc and time logged
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$LOG"
    local t0=$SECONDS limit_var="LIMIT_$name"
    # Each part's temporary files in a directory of its own, removed after it: a part killed at
    # its limit cannot clean up, and its leftovers (GiBs of checkpoints) must not fill the disk
    # under the next part.
    mkdir -p "$WORK/tmp-$name"
    TMPDIR="$WORK/tmp-$name" timeout --signal=KILL "${!limit_var:-$LIMIT_S}" "$@" \
        >"$WORK/$name.json" 2>"$WORK/$name.err"
    local rc=$?
    rm -rf "$WORK/tmp-$name"
    echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$LOG"
    echo "$name $rc $((SECONDS - t0))" >>"$WORK/parts.txt"
    tail -n 25 "$WORK/$name.err" >>"$LOG"
    # pytest's summary or failures; a failed bench's partial report
    if [ "$rc" != 0 ] || [ "$name" = test ]; then tail -n 60 "$WORK/$name.json" >>"$LOG"; fi
    # The summary so far, after every part: a call cut off at its limit still brings it back.
    "$PY" -m bench.gpu_summary "$WORK" >"$OUT/gpu_check.json" 2>>"$LOG"
}

BENCH=("$PY" -m bench.cli)
SAVE_METHODS=${SAVE_METHODS:+--methods $SAVE_METHODS}
RESTORE_METHODS=${RESTORE_METHODS:+--methods $RESTORE_METHODS}
run_part() {  # the parts run in the order PARTS names them
    case $1 in
    test) part test "$PY" -m pytest -q --tb=short -p no:cacheprovider tests/device/test_cuda.py ;;
    save) part save "${BENCH[@]}" save --device "$DEVICE" --size "$SIZE" --tensors 16 \
        --repeat "$REPEAT" --warmup 1 $SAVE_METHODS --json ;;
    first) part first "${BENCH[@]}" save --device "$DEVICE" --size "$SIZE" --tensors 16 \
        --repeat "$REPEAT" --warmup 0 --methods "$FIRST_METHODS" --json ;;
    reserved) part reserved "${BENCH[@]}" save --device "$DEVICE" --size "$SIZE" --tensors 16 \
        --repeat "$REPEAT" --warmup 0 --reserve --methods "$FIRST_METHODS" --json ;;
    restore) part restore "${BENCH[@]}" restore --device "$DEVICE" --size "$SIZE" --tensors 16 \
        --repeat "$REPEAT" $RESTORE_METHODS --json ;;
    loop) part loop "${BENCH[@]}" interference --device "$DEVICE" --size "$LOOP_SIZE" \
        --tensors 16 --steps "$LOOP_STEPS" --every 40 --json ;;
    # Issue 36 on the machine's cores (not its GPU): a node of 2 ranks wiped, restored from its
    # peers' copies, against DCP's load of the same state; 4 rank processes.
    recover | recover_dcp)
        local frontend=checkpointer
        [ "$1" = recover_dcp ] && frontend=dcp
        part "$1" "${BENCH[@]}" recover --frontend "$frontend" --ranks 4 --ranks-per-node 2 \
            --size "$RECOVER_SIZE" --repeat "$REPEAT" --durable "$WORK/tmp-$1/durable" --json ;;
    *) echo "unknown part $1 ($ALL_PARTS)" | tee -a "$LOG" ;;
    esac
}
for name in $PARTS; do run_part "$name"; done

"$PY" -m bench.gpu_summary "$WORK" >"$OUT/gpu_check.json" 2>>"$LOG"
echo "summary rc=$?" >>"$LOG"
cat "$OUT/gpu_check.json" | "$PY" -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["targets"], indent=1))' | tee -a "$LOG"
rm -rf "$WORK"
