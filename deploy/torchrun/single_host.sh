#!/usr/bin/env bash
# One host: a lighthouse and R replica groups, one torchrun of S ranks each, running the example trainer (or
# your module). A group that fails is restarted twice over: torchrun restarts its workers in place
# (--max-restarts), and when torchrun itself gives up or is killed, this script starts a new torchrun for the
# group (up to --group-restarts times). Every restarted group registers as joining and catches up.
#
#   deploy/torchrun/single_host.sh --replicas 3 --ranks 2 --steps 60 --model tiny --kill 1@20
#
# Options (defaults in brackets): --replicas R [3]  --ranks S [2]  --steps N [60]  --model M [tiny]
#   --module MOD [fthsdp.examples.train]  --backend gloo|nccl [torch's choice]  --timeout SECONDS [5]
#   --max-restarts K [3] (torchrun, in place)  --group-restarts G [10]  --restart-delay SECONDS [2]
#   --kill I@STEP[:PHASE] (SIGKILL group I once, at that step; test/demo only)  --workdir DIR [a temp dir]
#   --gpus-per-group K (group i sees GPUs i*K..i*K+K-1 through CUDA_VISIBLE_DEVICES; 0: no pinning [0])
#   --gpu-map 'G,G;G,G;...' (group i sees the i-th ';'-separated list, local rank k its k-th GPU; overrides
#     --gpus-per-group: GPUs shared between groups, e.g. '0,1;1,0' runs 2 groups x 2 ranks on 2 GPUs)
#   -- ARGS...  (passed to the trainer after --steps/--model)
# Exit status: 0 when every group finished; otherwise that of the first group that gave up.
set -uo pipefail

REPLICAS=3 RANKS=2 STEPS=60 MODEL=tiny MODULE=fthsdp.examples.train BACKEND="" TIMEOUT=5
MAX_RESTARTS=3 GROUP_RESTARTS=10 RESTART_DELAY=2 KILL="" WORKDIR="" GPUS_PER_GROUP=0 GPU_MAP="" EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --replicas) REPLICAS=$2; shift 2 ;;
        --ranks) RANKS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --module) MODULE=$2; shift 2 ;;
        --backend) BACKEND=$2; shift 2 ;;
        --timeout) TIMEOUT=$2; shift 2 ;;
        --max-restarts) MAX_RESTARTS=$2; shift 2 ;;
        --group-restarts) GROUP_RESTARTS=$2; shift 2 ;;
        --restart-delay) RESTART_DELAY=$2; shift 2 ;;
        --kill) KILL=$2; shift 2 ;;
        --workdir) WORKDIR=$2; shift 2 ;;
        --gpus-per-group) GPUS_PER_GROUP=$2; shift 2 ;;
        --gpu-map) GPU_MAP=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "single_host.sh: unknown option $1" >&2; exit 2 ;;
    esac
done

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY=python3; fi
fi
WORKDIR=${WORKDIR:-$(mktemp -d -t fthsdp-single-host.XXXXXX)}
mkdir -p "$WORKDIR"
cd "$REPO"
set -m  # every background job in its own process group: cleanup ends exactly what this script started

PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- the lighthouse, on free loopback ports --------------------------------------------------------------------
"$PY" -m fthsdp --log-level WARNING lighthouse --bind 127.0.0.1:0 --http 127.0.0.1:0 \
    --expected-replicas "$REPLICAS" --join-window 30 --min-replicas 1 --heartbeat-timeout 5 \
    --port-file "$WORKDIR/lighthouse.ports" >"$WORKDIR/lighthouse.log" 2>&1 &
LH_PID=$!
PIDS+=("$LH_PID")
for _ in $(seq 600); do  # up to 60 s for the lighthouse to write its ports
    [ -s "$WORKDIR/lighthouse.ports" ] && break
    kill -0 "$LH_PID" 2>/dev/null || { echo "lighthouse exited; see $WORKDIR/lighthouse.log" >&2; exit 1; }
    sleep 0.1
done
[ -s "$WORKDIR/lighthouse.ports" ] || { echo "lighthouse did not start within 60 s" >&2; exit 1; }
read -r GRPC HTTP RDZV <"$WORKDIR/lighthouse.ports"
LIGHTHOUSE="127.0.0.1:${GRPC#grpc=}"
HTTP_ADDR="127.0.0.1:${HTTP#http=}"
echo "lighthouse $LIGHTHOUSE  page http://$HTTP_ADDR/  (workdir $WORKDIR)"

# --- one supervised torchrun per replica group -----------------------------------------------------------------
count_fatal() {  # fatal events the example trainer wrote to its progress file
    local n
    n=$(grep -c '"event": "fatal"' "$1" 2>/dev/null)
    echo "${n:-0}"
}

run_group() {
    local index=$1 attempt=0 code fault=""
    if [ -n "$KILL" ] && [ "${KILL%%@*}" = "$index" ]; then fault=${KILL#*@}; fi
    local progress="$WORKDIR/replica$index.progress.jsonl" fatal_before gpus=""
    if [ -n "$GPU_MAP" ]; then
        IFS=';' read -r -a gpu_lists <<<"$GPU_MAP"
        gpus=${gpu_lists[$index]:-}
        [ -n "$gpus" ] || { echo "group $index: --gpu-map '$GPU_MAP' has no entry for it" >&2; return 2; }
    elif [ "$GPUS_PER_GROUP" -gt 0 ]; then
        gpus=$(seq -s, $((index * GPUS_PER_GROUP)) $((index * GPUS_PER_GROUP + GPUS_PER_GROUP - 1)))
    fi
    while :; do
        attempt=$((attempt + 1))
        fatal_before=$(count_fatal "$progress")
        echo "group $index: start (incarnation $attempt)"
        env FTHSDP_LIGHTHOUSE="$LIGHTHOUSE" FTHSDP_REPLICA_INDEX="$index" FTHSDP_NUM_REPLICAS="$REPLICAS" \
            FTHSDP_TIMEOUT="$TIMEOUT" ${BACKEND:+FTHSDP_BACKEND="$BACKEND"} ${fault:+FTHSDP_FAULT="$fault"} \
            FTHSDP_PROGRESS="$progress" ${gpus:+CUDA_VISIBLE_DEVICES="$gpus"} \
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node "$RANKS" --max-restarts "$MAX_RESTARTS" \
            -m "$MODULE" --steps "$STEPS" --model "$MODEL" "${EXTRA[@]}" >>"$WORKDIR/replica$index.log" 2>&1
        code=$?
        fault=""  # the kill happens once
        if [ "$code" -eq 0 ]; then
            echo "group $index: finished"
            return 0
        fi
        # 75: the group asked to rejoin (torchrun reports it as 1); anything else: crashed or killed.
        echo "group $index: exit status $code (incarnation $attempt)"
        if [ "$(count_fatal "$progress")" != "$fatal_before" ]; then
            # The trainer reported an error a restart cannot fix (e.g. nobody left to catch up from).
            echo "group $index: fatal: $(grep '"event": "fatal"' "$progress" | tail -n 1)" >&2
            return "$code"
        fi
        if [ "$attempt" -gt "$GROUP_RESTARTS" ]; then
            echo "group $index: gave up after $attempt incarnations; see $WORKDIR/replica$index.log" >&2
            return "$code"
        fi
        sleep "$RESTART_DELAY"  # restart back-off
    done
}

GROUPS_PIDS=()
for ((i = 0; i < REPLICAS; i++)); do
    run_group "$i" &
    GROUPS_PIDS+=("$!")
    PIDS+=("$!")
done
STATUS=0
for pid in "${GROUPS_PIDS[@]}"; do
    wait "$pid"
    code=$?
    if [ "$code" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$code; fi
done
"$PY" -m fthsdp status --http "$HTTP_ADDR" --history 20 || true
exit "$STATUS"
