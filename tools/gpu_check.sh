#!/usr/bin/env bash
# One prepared GPU check, for a person with a GPU to run once (about 8 minutes at most on one GPU):
#
#     bash tools/gpu_check.sh [OUT_DIR]        # default OUT_DIR: results/gpu
#
# 1. the GPU test set (python -m pytest -m gpu), 2. SyncBatchNorm on CUDA against BatchNorm1d + its two sums
# and against torch.nn.SyncBatchNorm (2 processes sharing the GPU over gloo), 3. DDP's own overhead over no DDP,
# ours against PyTorch's best (a world of one over NCCL: resnet18 and the CNN). Each step has a time limit,
# writes its log and its results file to OUT_DIR, and a failed step does not stop the others; the exit code
# is the number of steps that failed. Nothing is installed: it runs on the machine's own torch (2.11 or newer).
# Its CPU twin, the same steps on the CPU over gloo: DEVICE=cpu bash tools/gpu_check.sh /tmp/gpu-check
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
device=${DEVICE:-cuda}
ddp_backend=$([ "$device" = cuda ] && echo nccl || echo gloo)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0

step() {  # step NAME SECONDS COMMAND...: run COMMAND with a limit, its output to the terminal and OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name (at most $limit s): $*"
    local start=$SECONDS
    timeout --kill-after 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "=== $name: exit $code after $((SECONDS - start)) s" | tee -a "$out/$name.log"
    [ "$code" -eq 0 ] || failed=$((failed + 1))
}

python - <<'PY' | tee "$out/environment.log"
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPUs", torch.cuda.device_count(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible")
PY
step pytest-gpu 200 python -m pytest -m gpu -p no:cacheprovider -q
step syncbn 120 python syncbn_benchmark.py --quick --settings workers --dtypes float32 bfloat16 \
    --device "$device" --backend gloo --json "$out/syncbn_benchmark.$device.json"
step ddp-world1 150 torchrun --standalone --nproc_per_node 1 ddp_benchmark.py --models resnet18 cnn \
    --variants "ddp pytorch" "ddp pytorch best" "ddp ours" --bucket-sizes 25 --iters 60 --rounds 8 \
    --device "$device" --backend "$ddp_backend" --json "$out/ddp_benchmark.$device-world1.json"
echo "=== $failed step(s) failed; logs and results in $out"
exit "$failed"
