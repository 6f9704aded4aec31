#!/usr/bin/env bash
# The NCCL path on real GPUs: R replica groups of S ranks of the example trainer with FTHSDP_BACKEND=nccl
# (FSDP2 inside each group and the FTAR lanes across groups over NCCL), one group SIGKILLed mid-run,
# restarted, and rejoining; then a JSON report (what ran, step and exchange times, rejoin, final state hashes).
#
#   deploy/gpu/nccl_check.sh                         # 2 groups x 1 rank, 60 steps, kill group 1 at step 20
#   deploy/gpu/nccl_check.sh --replicas 3 --ranks 2 --steps 100 --kill 2@40 --out out/gpu
#
# NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", NVIDIA/nccl#418),
# so every rank gets its own GPU (group i: GPUs i*S..i*S+S-1) and the check needs R*S GPUs. With fewer
# (e.g. one GPU), it runs the single-GPU smoke instead: 1 group x 1 rank on NCCL (CUDA compute, NCCL
# process groups, FTAR with one member), no kill; the report says so ("mode": "single-gpu").
# Exit status: 0 when every group finished with the same state hash; 3 without a CUDA GPU; else 1.
set -uo pipefail

REPLICAS=2 RANKS=1 STEPS=60 MODEL=reference KILL=1@20 MIN_STEP_S=0 TIMEOUT=10 OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
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
mkdir -p "$OUT"

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
GPUS=${GPUS:-0}
if [ "$GPUS" -lt 1 ]; then
    echo "nccl_check.sh: no CUDA GPU visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
    exit 3
fi
MODE=multi-replica
if [ "$GPUS" -lt $((REPLICAS * RANKS)) ]; then
    echo "nccl_check.sh: $REPLICAS groups x $RANKS ranks need $((REPLICAS * RANKS)) GPUs (NCCL: one rank per GPU);" \
         "$GPUS visible: running the single-GPU smoke (1 group x 1 rank, no kill)" >&2
    MODE=single-gpu REPLICAS=1 RANKS=1 KILL=""
fi

{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true; } \
    >"$OUT/gpus.txt"
"$PY" - >"$OUT/versions.json" <<'PYEOF'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
                  "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PYEOF

T0=$(date +%s.%N)
FTHSDP_LOG_LEVEL=INFO "$REPO/deploy/torchrun/single_host.sh" --replicas "$REPLICAS" --ranks "$RANKS" \
    --steps "$STEPS" --model "$MODEL" --backend nccl --gpus-per-group "$RANKS" --timeout "$TIMEOUT" \
    --restart-delay 1 ${KILL:+--kill "$KILL"} --workdir "$OUT/run" -- --min-step-s "$MIN_STEP_S" \
    2>&1 | tee "$OUT/run.txt"
STATUS=${PIPESTATUS[0]}
T1=$(date +%s.%N)

"$PY" - "$OUT" "$MODE" "$REPLICAS" "$RANKS" "$STEPS" "$MODEL" "$KILL" "$STATUS" "$T0" "$T1" <<'PYEOF' \
    | tee "$OUT/report.json"
import json, pathlib, statistics, sys
out, mode, replicas, ranks, steps, model, kill, status, t0, t1 = sys.argv[1:]
out = pathlib.Path(out)
report = {"mode": mode, "replicas": int(replicas), "ranks_per_replica": int(ranks), "steps": int(steps),
          "model": model, "kill": kill or None, "exit_status": int(status), "wall_s": round(float(t1) - float(t0), 1),
          "versions": json.loads((out / "versions.json").read_text()),
          "gpus": (out / "gpus.txt").read_text().strip().splitlines(), "replica": {}}
hashes = set()
for i in range(int(replicas)):
    path = out / "run" / f"replica{i}.progress.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []
    st = [x for x in rows if x.get("event") == "step"]
    normal = [x for x in st if not x.get("joined") and x.get("attempts", 1) == 1]
    final = next((x for x in reversed(rows) if x.get("event") == "final"), None)
    starts = [x["t"] for x in rows if x.get("event") == "start"]
    joined = [x for x in st if x.get("joined")]
    r = {"incarnations": len(starts), "steps_committed": len(st),
         "median_step_s": round(statistics.median(x["step_s"] for x in normal), 4) if normal else None,
         "median_exchange_s": round(statistics.median(x["exchange_s"] for x in normal if x.get("exchange_s") is not None), 4)
         if any(x.get("exchange_s") is not None for x in normal) else None,
         "max_attempts": max((x.get("attempts", 1) for x in st), default=None),
         "final_step": final["step"] if final else None, "param_hash": final.get("param_hash") if final else None,
         "fatal": [x["error"] for x in rows if x.get("event") == "fatal"]}
    if len(starts) > 1 and joined:
        before = [x["t"] for x in st if x["t"] < starts[-1]]
        r["registered_to_joined_step_s"] = round(joined[0]["t"] - starts[-1], 3)  # catch-up of the new incarnation
        if before:  # from its last commit before the kill to its first step as a joiner: restart + catch-up
            r["last_commit_to_joined_step_s"] = round(joined[0]["t"] - before[-1], 3)
    if final and final.get("param_hash"):
        hashes.add(final["param_hash"])
    report["replica"][str(i)] = r
report["all_final_hashes_equal"] = len(hashes) == 1 and all(v["param_hash"] for v in report["replica"].values())
report["ok"] = report["exit_status"] == 0 and report["all_final_hashes_equal"]
print(json.dumps(report, indent=2))
sys.exit(0 if report["ok"] else 1)
PYEOF
exit "${PIPESTATUS[0]}"
