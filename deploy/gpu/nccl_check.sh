#!/usr/bin/env bash
# The NCCL path on real GPUs: R replica groups of S ranks of the example trainer with FTHSDP_BACKEND=nccl
# (FSDP2 inside each group and the FTAR lanes across groups over NCCL), one group SIGKILLed in the middle of the
# runtime's exchange (its buckets in flight), restarted, and rejoining; then a JSON report (what ran, the GPU
# layout, step and exchange times, rejoin, final state hashes) and a verdict.
#
#   deploy/gpu/nccl_check.sh                         # 2 groups x 2 ranks, 60 steps, kill group 1 at step 20's exchange
#   deploy/gpu/nccl_check.sh --replicas 3 --ranks 2 --steps 100 --kill 2@40:exchange-late --out out/gpu
#   deploy/gpu/nccl_check.sh --single-gpu            # the one-GPU smoke, even with more GPUs
#
# NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", NVIDIA/nccl#418). Each
# rank is in two communicators: its group's (FSDP2: the group's S ranks) and its lane's (FTAR: rank k of every
# group). So the GPUs are laid out (through CUDA_VISIBLE_DEVICES, single_host.sh --gpu-map) as:
#   - "dedicated", with at least R*S GPUs: group i on GPUs i*S..i*S+S-1, no GPU shared;
#   - "shared", with G GPUs, max(R,S) <= G < R*S: group i's rank k on GPU (i+k) mod G, a Latin square: the S
#     ranks of a group are on S different GPUs, and so are the R ranks of a lane (2 x 2 on two GPUs: '0,1;1,0');
#   - "single-gpu" otherwise (one GPU): the smoke, 1 group x 1 rank on NCCL (CUDA compute, NCCL process groups,
#     FTAR with one member), no kill.
# Kill phases (fthsdp/runtime/faults.py): forward, backward, exchange, exchange-late, vote, optimizer.
# --min-step-s paces every step (default 0.75 s), so that the survivors are still training when the killed group
# is back (its restart and catch-up take 10-20 s): the rejoin is part of what is checked.
# Options: --replicas R [2] --ranks S [2] --steps N [60] --model M [reference] --kill G@STEP[:PHASE]
#   [1@20:exchange] --no-kill --min-step-s S [0.75] --timeout S [10] --out DIR [a temp dir] --single-gpu
# Exit status: 0 when every group exited 0, reached the last step and ended with the same state hash, and the
# killed group was really killed and came back (a later incarnation); 1 otherwise (the hashes differ, one is
# missing, a group failed, the kill never fired); 2 on a bad option; 3 without a CUDA GPU.
set -uo pipefail

REPLICAS=2 RANKS=2 STEPS=60 MODEL=reference KILL=1@20:exchange MIN_STEP_S=0.75 TIMEOUT=10 OUT="" SINGLE=""
BACKEND=nccl ASSUME_GPUS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --single-gpu) SINGLE=--single; shift ;;
        --backend) BACKEND=$2; shift 2 ;;          # test only: gloo runs the same plumbing on CPU
        --assume-gpus) ASSUME_GPUS=$2; shift 2 ;;  # test only: lay out for this many GPUs without looking
        --replicas) REPLICAS=$2; shift 2 ;;
        --ranks) RANKS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --kill) KILL=$2; shift 2 ;;
        --no-kill) KILL=""; shift ;;
        --min-step-s) MIN_STEP_S=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        *) echo "nccl_check.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
OUT=${OUT:-$(mktemp -d -t fthsdp-nccl-check.XXXXXX)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)

if [ -n "$ASSUME_GPUS" ]; then
    GPUS=$ASSUME_GPUS
else
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
    GPUS=${GPUS:-0}
    if [ "$GPUS" -lt 1 ]; then
        echo "nccl_check.sh: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
        exit 3
    fi
fi
if [ -n "$KILL" ]; then
    case "$KILL" in
        *@*) ;;
        *) echo "nccl_check.sh: --kill wants GROUP@STEP[:PHASE], got '$KILL'" >&2; exit 2 ;;
    esac
    if [ "${KILL%%@*}" -ge "$REPLICAS" ]; then
        echo "nccl_check.sh: --kill $KILL names group ${KILL%%@*}, but there are $REPLICAS groups" >&2; exit 2
    fi
fi
# Where each rank runs (fthsdp/testing/nccl_report.py, layout): dedicated, shared (Latin square) or single-gpu.
read -r MODE GPU_MAP < <(cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report layout --replicas "$REPLICAS" \
    --ranks "$RANKS" --gpus "$GPUS" $SINGLE)
[ -n "${MODE:-}" ] || { echo "nccl_check.sh: cannot lay out the ranks (python -m fthsdp.testing.nccl_report)" >&2; exit 1; }
if [ "$MODE" = single-gpu ]; then
    [ -n "$SINGLE" ] || echo "nccl_check.sh: $REPLICAS groups x $RANKS ranks need at least" \
        "$((REPLICAS > RANKS ? REPLICAS : RANKS)) GPUs (NCCL: no GPU twice in a group or a lane); $GPUS visible:" \
        "running the single-GPU smoke (1 group x 1 rank, no kill)" >&2
    REPLICAS=1 RANKS=1 KILL=""
fi
echo "nccl_check.sh: $MODE: $REPLICAS groups x $RANKS ranks on $GPUS GPUs, GPUs per group '$GPU_MAP'," \
     "kill ${KILL:-none}"

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true; } \
    >"$OUT/gpus.txt"
"$PY" - >"$OUT/versions.json" <<'PYEOF'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                  "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PYEOF

T0=$SECONDS
FTHSDP_LOG_LEVEL=INFO "$REPO/deploy/torchrun/single_host.sh" --replicas "$REPLICAS" --ranks "$RANKS" \
    --steps "$STEPS" --model "$MODEL" --backend "$BACKEND" --gpu-map "$GPU_MAP" --timeout "$TIMEOUT" \
    --restart-delay 1 ${KILL:+--kill "$KILL"} --workdir "$OUT/run" -- --min-step-s "$MIN_STEP_S" \
    2>&1 | tee "$OUT/run.txt"
STATUS=${PIPESTATUS[0]}
WALL_S=$((SECONDS - T0))

(cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report report "$OUT" "$MODE" "$REPLICAS" "$RANKS" "$STEPS" "$MODEL" \
    "$KILL" "$STATUS" "$WALL_S" "$GPU_MAP") | tee "$OUT/report.json"
exit "${PIPESTATUS[0]}"
