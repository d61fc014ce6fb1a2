#!/usr/bin/env bash
# The CUDA/NCCL checks of ShardShift, as one short script for a machine with a GPU (docs/gpu.md).
#
#   bash scripts/check-gpu.sh [OUTDIR]     # from the repository root; OUTDIR defaults to gpu-check/
#
# It runs the package from this checkout (PYTHONPATH) under the machine's own torch, so it needs
# no install. Every step has its own time limit and the next one runs whatever the last one did;
# one line per step goes to OUTDIR/summary.txt and the logs and JSON results into OUTDIR/logs.tgz.
# Steps that need more GPUs than the machine has are refused by ShardShift (that is checked) or
# skipped, and say so.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
logs=$work/logs
mkdir -p "$logs"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The whole script ends within CHECK_GPU_SECONDS: each step gets at most what is left of it (less a
# margin for packing the logs), and the last, the CPU switch bench, whatever remains.
deadline=$(( $(date +%s) + ${CHECK_GPU_SECONDS:-560} ))
dev=${CHECK_GPU_DEVICE:-cuda}  # cpu: a dry run of this script on a machine without a GPU

ss=("$py" -m shardshift)

step() {  # step NAME LIMIT_S COMMAND...: run it, log it, one summary line
    local name=$1 limit=$2 rc start left
    shift 2
    left=$(( deadline - $(date +%s) - 15 ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, ${left} s left of CHECK_GPU_SECONDS" | tee -a "$out/summary.txt"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: $*" | tee -a "$out/summary.txt"
    start=$(date +%s%N)
    timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    echo "    rc=$rc in $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$out/summary.txt"
    grep -E "^(training|switched|done|resuming|shardshift: error|CUDA sees|layout|ddp|dp=|model)|Error|error:|Dup" \
        "$logs/$name.log" | tail -n 12 | sed 's/^/    /' | tee -a "$out/summary.txt"
    return 0
}

step env 40 bash -c "nvidia-smi -L; nproc; $py - <<'EOF'
import torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())
print('nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')
EOF"
sed 's/^/    /' "$logs/env.log" | tee -a "$out/summary.txt"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

ck=$work/ck
# One rank on the GPU (NCCL): FSDP2 and DTensor on CUDA, the switch executor's local path twice
# (dp=1 -> fsdp=1 -> dp=1), a DCP checkpoint at step 20 written from GPU memory.
step cuda-train 90 "${ss[@]}" train --device $dev --nproc 1 --layout dp=1 --model tiny --steps 40 --stop-at 20 \
    --switch 5:fsdp=1 --switch 10:dp=1 --save "$ck" --metrics "$logs/cuda-train.jsonl" --log-every 5
# The GPU's checkpoint resumed on the GPU, and on four CPU ranks under another layout.
step cuda-resume 60 "${ss[@]}" train --device $dev --nproc 1 --layout dp=1 --model tiny --steps 40 --resume "$ck" \
    --metrics "$logs/cuda-resume.jsonl" --log-every 5
step cpu-resume-of-gpu-checkpoint 60 "${ss[@]}" train --device cpu --nproc 4 --layout fsdp=2,tp=2 --model tiny \
    --steps 40 --resume "$ck" --metrics "$logs/cpu-resume.jsonl" --log-every 5
# float64 on the GPU against float64 on the CPU, one rank each: the same run to rounding.
step cuda-float64 60 "${ss[@]}" train --device $dev --nproc 1 --layout dp=1 --model tiny --steps 15 --dtype float64 \
    --metrics "$logs/cuda-f64.jsonl" --log-every 5
step cpu-float64 60 "${ss[@]}" train --device cpu --nproc 1 --layout dp=1 --model tiny --steps 15 --dtype float64 \
    --metrics "$logs/cpu-f64.jsonl" --log-every 5
"$py" - "$logs" <<'EOF' 2>&1 | tee -a "$out/summary.txt"
import json, sys
from pathlib import Path
logs = Path(sys.argv[1])
def losses(name):
    path = logs / name
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}
for a, b in (("cuda-f64.jsonl", "cpu-f64.jsonl"), ("cuda-resume.jsonl", "cpu-resume.jsonl")):
    la, lb = losses(a), losses(b)
    common = sorted(set(la) & set(lb))
    if not common:
        print(f"    {a} vs {b}: no common steps"); continue
    worst = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in common)
    print(f"    {a} vs {b}: {len(common)} steps, worst relative loss difference {worst:.3e}, "
          f"last {la[common[-1]]:.6f} vs {lb[common[-1]]:.6f}")
EOF
step cuda-bf16 60 "${ss[@]}" train --device $dev --nproc 1 --layout dp=1 --model small --steps 30 --dtype bfloat16 \
    --log-every 10
# Tokens/s of the `base` model on the GPU: ShardShift's one-rank layout beside plain DDP.
step bench-train-cuda 90 "${ss[@]}" bench train --device $dev --nproc 1 --layout dp=1 --also '' --model base \
    --global-batch 16 --steps 5 --rounds 3 --warmup 2
# The switch model's local-copy inputs on this GPU (what `bench switch --predict` measures per rank).
cat >"$work/copy_rates.py" <<'EOF'
import sys, torch
from shardshift.bench.switch import copy_rate, piece_cost
device = torch.device(sys.argv[1], 0) if sys.argv[1] == "cuda" else torch.device("cpu")
for size in (64 << 20, 1 << 30):
    print(f"{device.type} copy of {size >> 20} MiB: contiguous {copy_rate(size, device) / 1e9:.1f} GB/s, "
          f"strided {copy_rate(size, device, strided=True) / 1e9:.1f} GB/s (bytes copied per second)")
print(f"{device.type} piece cost: {piece_cost(device) * 1e6:.2f} us per piece end")
EOF
step copy-rates 40 "$py" "$work/copy_rates.py" "$dev"
sed "s/^/    /" "$logs/copy-rates.log" 2>/dev/null | tail -n 4 | tee -a "$out/summary.txt"
# More ranks than GPUs: ShardShift refuses --device cuda, and auto trains on the CPU and says why.
if [ "$gpus" -lt 2 ]; then
    step refuse-cuda-ranks-over-gpus 30 "${ss[@]}" train --device $dev --nproc 2 --layout dp=2 --model tiny --steps 2
    # What NCCL itself does with two ranks on one GPU (the reason for the refusal).
    cat >"$work/two_ranks_one_gpu.py" <<'EOF'
import os, tempfile, datetime
import torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r, path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(path, 2), rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=30), device_id=torch.device("cuda", 0))
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {r}: all_reduce gave {x.tolist()}", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, args=(tempfile.mktemp(),), nprocs=2)
EOF
    step nccl-two-ranks-one-gpu 45 "$py" "$work/two_ranks_one_gpu.py"
    step default-job-on-one-gpu 120 "${ss[@]}" train --run-dir "$work/default-run"
else
    step cuda-switch-bench 100000 "${ss[@]}" bench switch --device cuda --nproc "$gpus" \
        --suite "dp=$gpus;fsdp=$gpus" --no-restart --repeat 3 --predict --json
fi
# The switch bench on this machine's CPU cores (more than CI's two): four gloo ranks, predicted beside measured.
step bench-switch-cpu 100000 bash -c "$py -m shardshift bench switch --device cpu --nproc 4 \
    --suite 'fsdp=4;fsdp=2,tp=2;dp=2,fsdp=2;tp=4' --no-restart --repeat 3 --predict --json \
    > '$logs/bench-switch-cpu.json'"
"$py" - "$logs/bench-switch-cpu.json" <<'EOF' 2>&1 | tee -a "$out/summary.txt"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except Exception as err:
    print(f"    no bench result: {err}"); raise SystemExit
print(f"    {doc['nproc']} {doc['device']} ranks on {doc['cores']} cores, {doc['repeats']} repeats")
for t in doc["transitions"]:
    nan = float("nan")
    print(f"    {t['from']:>12} -> {t['to']:<12} switch {t['switch_seconds']:.3f} s, "
          f"moving {t['move_seconds']:.3f} s ({t['move_cpu_seconds']:.2f} core-s), "
          f"limit {t['limit_seconds']:.3f} s (sw/lim {t['switch_over_limit']:.2f}), "
          f"predicted {t.get('predicted_seconds', nan):.3f} s (x{t.get('predicted_over_move', nan):.2f}), "
          f"dcp {t['dcp_seconds']:.2f} s (dcp/sw {t['dcp_over_switch']:.1f})")
print("    geomean", {k: round(v, 3) for k, v in doc["geomean"].items() if isinstance(v, (int, float))})
EOF
cp "$logs/bench-switch-cpu.json" "$out/" 2>/dev/null
tar czf "$out/logs.tgz" -C "$work" logs
echo "logs: $out/logs.tgz"
