#!/usr/bin/env bash
# The README's "Vision encoder" tables in one call on the device machine: our encoder
# (`vit_bench`) and PyTorch's (`vit_torch.py`) on the same GPU, at batch 1, 8 and 17, one JSON
# line per run on stdout.
#
#   benches/h200/encoder_vs_torch.sh VIT_BENCH [ITERS]
#
# VIT_BENCH is a release build of the example (`cargo build --release -p pipeline --features
# vision --example vit_bench`, then target/release/examples/vit_bench), copied to the machine:
# it has no cargo. Ours runs first and PyTorch second, so the GPU's clocks are warm for both.
# The README quotes the median of our three runs per batch; the first two also print a kernel
# profile from GPU timestamps (`kernel_ms`), taken after the timed runs.
set -uo pipefail
bench=${1:?usage: encoder_vs_torch.sh VIT_BENCH [ITERS]}
iters=${2:-30}
here=$(dirname "$0")
for round in 1 2 3; do
  profile=profile
  [ "$round" = 3 ] && profile=
  for batch in 1 8 17; do
    "$bench" b16-512 gpu "$iters" coop tiled "batch:$batch" $profile 2>/dev/null | tail -1
  done
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader >&2
# PyTorch: each mode in its own process with a time limit, the strongest configurations first,
# so that a slow compilation costs only its own rows (on the H200, max-autotune's warm-up takes
# 40-65 s per batch size).
torch_mode() {
  timeout "$1" python3 "$here/vit_torch.py" --modes "$2" --batches "$3" --iters "$iters" \
    || echo "{\"mode\": \"$2\", \"batches\": \"$3\", \"error\": \"exit $? (timeout $1 s)\"}"
}
torch_mode 60 sdpa 1,8,17
torch_mode 150 max-autotune 1
torch_mode 60 eager 1,8,17
torch_mode 150 max-autotune 8
torch_mode 90 compile 1
torch_mode 150 max-autotune 17
torch_mode 90 compile 8,17
