#!/usr/bin/env bash
# The README's "Vision encoder" table in one call on the device machine: our encoder
# (`vit_bench`) and PyTorch's (`vit_torch.py`) on the same GPU, at batch 1, 8 and 17, one JSON
# line per configuration on stdout.
#
#   benches/h200/encoder_vs_torch.sh VIT_BENCH [ITERS]
#
# VIT_BENCH is a release build of the example (`cargo build --release -p pipeline --example
# vit_bench`, then target/release/examples/vit_bench), copied to the machine: it has no cargo.
# Ours runs first and PyTorch second, so the GPU's clocks are warm for both.
set -euo pipefail
bench=${1:?usage: encoder_vs_torch.sh VIT_BENCH [ITERS]}
iters=${2:-30}
here=$(dirname "$0")
for batch in 1 8 17; do
  "$bench" b16-512 gpu "$iters" coop tiled "batch:$batch" 2>/dev/null | tail -1
done
# The batch-1 kernel profile (TFLOP/s per kernel) for the README's profile table.
"$bench" b16-512 gpu "$iters" coop tiled profile 2>/dev/null | tail -1
python3 "$here/vit_torch.py" --batches 1,8,17 --iters "$iters"
