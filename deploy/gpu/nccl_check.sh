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
#   - "one-gpu" otherwise (one GPU, or too few for a Latin square): every rank on GPU 0, each a host of its own to
#     NCCL (NCCL_HOSTID; sockets over loopback). NCCL keys its "Duplicate GPU" refusal on the host hash and the bus
#     id, so this lets several processes share one GPU; unsupported by NVIDIA, so the check proves it first:
#       A. deploy/gpu/two_on_one.py: two ranks of one communicator on the GPU without NCCL_HOSTID (the control,
#          expected to be refused) and with one each (must work); if it does not work, the smoke runs instead and
#          the check FAILS (it never reports ok for what it did not run);
#       B. deploy/gpu/peer_kill_check.py: FTAR's own lane group against a peer SIGKILLed mid-collective, under
#          fthsdp's watchdog settings (the survivor must live, find the failure and rebuild) and under c10d's
#          defaults (the control, reported);
#       C. the trainer end to end: R groups x 1 rank, then R x S, each with the kill, every survivor in one
#          incarnation (deploy/gpu/one_gpu_site/sitecustomize.py gives each torchrun worker its NCCL_HOSTID);
#   - "single-gpu" with --single-gpu: the smoke, 1 group x 1 rank on NCCL (CUDA compute, NCCL process groups, FTAR
#     with one member), no kill.
# Kill phases (fthsdp/runtime/faults.py): forward, backward, exchange, exchange-late, vote, optimizer.
# --min-step-s paces every step (default 0.75 s), so that the survivors are still training when the killed group
# is back (its restart and catch-up take 10-20 s): the rejoin is part of what is checked.
# Options: --replicas R [2] --ranks S [2] --steps N [60] --model M [reference] --kill G@STEP[:PHASE]
#   [1@20:exchange] --no-kill --min-step-s S [0.75] --timeout S [10] --out DIR [a temp dir] --single-gpu
# Output under --out: runs/<name>/report.json per trainer run, two_on_one.json and peer_kill.*.json (one-gpu), and
# summary.json, the verdict (fthsdp/testing/nccl_report.py: summary).
# Exit status: 0 when every part ran as asked and passed: every group exited 0, reached the last step with the same
# state hash, the killed group was really killed and came back (a later incarnation) and no survivor ran twice; in
# one-gpu mode also A and B; 1 otherwise; 2 on a bad option; 3 without a CUDA GPU.
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
# Where each rank runs (fthsdp/testing/nccl_report.py, layout): dedicated, shared (Latin square), one-gpu (every
# rank on GPU 0 as a host of its own to NCCL) or single-gpu (the smoke, when asked).
read -r MODE GPU_MAP < <(cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report layout --replicas "$REPLICAS" \
    --ranks "$RANKS" --gpus "$GPUS" $SINGLE)
[ -n "${MODE:-}" ] || { echo "nccl_check.sh: cannot lay out the ranks (python -m fthsdp.testing.nccl_report)" >&2; exit 1; }
[ "$MODE" = single-gpu ] && REPLICAS=1 RANKS=1 KILL=""  # asked for the smoke
ASKED="$REPLICAS,$RANKS,$KILL"
mkdir -p "$OUT/runs"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_mode --format=csv,noheader 2>/dev/null \
    || true; } >"$OUT/gpus.txt"
"$PY" - >"$OUT/versions.json" <<'PYEOF'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                  "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PYEOF
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# One GPU shared by every rank: each a host of its own to NCCL, talking over sockets on loopback only.
ONE_GPU_ENV=(NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
             NCCL_NVLS_ENABLE=0 NCCL_MNNVL_ENABLE=0 CUDA_VISIBLE_DEVICES=0 TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=1500)

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run_check NAME R S KILL GPU_MAP MODE [ENV=VALUE...]: one single_host.sh run and its report in $OUT/runs/NAME.
run_check() {
    local name=$1 r=$2 s=$3 kill=$4 map=$5 mode=$6 dir="$OUT/runs/$1" t0=$SECONDS status
    shift 6
    mkdir -p "$dir" && cp "$OUT/gpus.txt" "$OUT/versions.json" "$dir/"
    echo "nccl_check.sh: $name: $mode, $r groups x $s ranks, GPUs per group '$map', kill ${kill:-none}"
    env "$@" FTHSDP_LOG_LEVEL=INFO "$REPO/deploy/torchrun/single_host.sh" --replicas "$r" --ranks "$s" \
        --steps "$STEPS" --model "$MODEL" --backend "$BACKEND" --gpu-map "$map" --timeout "$TIMEOUT" \
        --restart-delay 1 ${kill:+--kill "$kill"} --workdir "$dir/run" -- --min-step-s "$MIN_STEP_S" \
        2>&1 | tee "$dir/run.txt"
    status=${PIPESTATUS[0]}
    (cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report report "$dir" "$mode" "$r" "$s" "$STEPS" "$MODEL" "$kill" \
        "$status" $((SECONDS - t0)) "$map" --asked "$ASKED_RUN") >"$dir/report.json"
}

if [ "$MODE" = one-gpu ]; then
    # A. Two ranks of one communicator on one GPU: the control (no NCCL_HOSTID) must be refused, the trick work.
    mkdir -p "$OUT/two_on_one"
    for variant in control hostid; do
        port=$(free_port)
        for r in 0 1; do
            hostid=()
            [ "$variant" = hostid ] && hostid=(NCCL_HOSTID="fthsdp-two-on-one-$r")
            env "${ONE_GPU_ENV[@]}" "${hostid[@]}" timeout -s KILL 60 "$PY" "$HERE/two_on_one.py" "$r" "$port" \
                >"$OUT/two_on_one/$variant.r$r.log" 2>&1 &
        done
        wait
    done
    (cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report two-on-one "$OUT/two_on_one") >"$OUT/two_on_one.json"
    echo "nccl_check.sh: two ranks on one GPU: $(cat "$OUT/two_on_one.json")"
    if grep -q '"works": true' "$OUT/two_on_one.json"; then
        # B. FTAR's lane group against a peer SIGKILLed mid-collective: fthsdp's settings, then c10d's (the control).
        for settings in fixed shipped; do
            env "${ONE_GPU_ENV[@]}" timeout -s KILL 240 "$PY" "$HERE/peer_kill_check.py" --settings "$settings" \
                2>"$OUT/peer_kill.$settings.err" | tail -n 1 >"$OUT/peer_kill.$settings.json"
            echo "nccl_check.sh: peer kill ($settings): $(cut -c1-400 "$OUT/peer_kill.$settings.json")"
        done
        # C. The trainer end to end, every rank on the one GPU: R x 1, then R x S, each with the kill.
        for s in $(printf '%s\n' 1 "$RANKS" | sort -un); do
            map=$(printf '0%.0s' $(seq "$s") | sed 's/./&,/g; s/,$//')
            map=$(for ((i = 0; i < REPLICAS; i++)); do printf '%s;' "$map"; done); map=${map%;}
            ASKED_RUN="$REPLICAS,$s,$KILL"
            run_check "${REPLICAS}x$s" "$REPLICAS" "$s" "$KILL" "$map" one-gpu "${ONE_GPU_ENV[@]}" \
                PYTHONPATH="$HERE/one_gpu_site:$PYTHONPATH"
        done
    else
        echo "nccl_check.sh: two ranks on one GPU do not work here, even with NCCL_HOSTID: running the smoke" \
             "(1 group x 1 rank, no kill); the check fails, having run less than asked" >&2
        ASKED_RUN=$ASKED
        run_check smoke 1 1 "" 0 single-gpu
    fi
else
    ASKED_RUN=$ASKED
    run_check "${REPLICAS}x$RANKS" "$REPLICAS" "$RANKS" "$KILL" "$GPU_MAP" "$MODE"
fi
(cd "$REPO" && "$PY" -m fthsdp.testing.nccl_report summary "$OUT") | tee "$OUT/summary.json"
exit "${PIPESTATUS[0]}"
