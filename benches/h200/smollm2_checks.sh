#!/usr/bin/env bash
# Issue 15's real-model checks on the device machine: the GPU decoder on SmolLM2-135M-Instruct
# (Q4_1 GGUF) against the CPU NPU, with the tensor-core prefill GEMM on (the H200's default)
# and off. The machine has no network and one call carries at most 64 MiB, so the 98 MB model
# comes in parts over consecutive calls to a warm machine, which keeps /tmp between them.
#
# Here (this repository's machine):
#   split -b 30M -d models/SmolLM2-135M-Instruct.Q4_1.gguf .h200mid/smollm2.part.
#   cargo test --release -p pipeline --all-features --test smollm2 --no-run   # prints the binary
#   strip -o .h200base/smollm2 target/release/deps/smollm2-HASH
# Then one device call per part (carry the part, and the binary with the last one):
#   bash benches/h200/smollm2_checks.sh stash .h200mid/smollm2.part.00
#   bash benches/h200/smollm2_checks.sh stash .h200mid/smollm2.part.01
#   bash benches/h200/smollm2_checks.sh stash .h200mid/smollm2.part.02
#   bash benches/h200/smollm2_checks.sh run .h200base/smollm2 [.h200mid/smollm2.part.03 ...]
# (inside .h200d/run.sh, which unpacks the Vulkan loader). `run` joins the parts, checks the
# model's SHA-256 and runs the test binary's GPU tests twice, NPU_HAL_TENSOR_CORES=1 and =0;
# their output (max and mean logit error, greedy ids agreeing, both perplexities) is the
# record. The CPU-only tests of that binary read fixtures at this checkout's absolute path and
# are not run there; CI runs them here.
set -euo pipefail
store=/tmp/smollm2-parts
model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mode=${1:?usage: smollm2_checks.sh stash PART... | run TEST_BIN [PART...]}
shift
mkdir -p "$store"
stash() {
  for part in "$@"; do
    cp "$part" "$store/"
    echo "stashed $(basename "$part") ($(stat -c %s "$part") bytes); have: $(ls "$store" | tr '\n' ' ')"
  done
}
case "$mode" in
  stash) stash "$@" ;;
  run)
    bin=${1:?run needs the smollm2 test binary}
    shift
    stash "$@"
    cat "$store"/smollm2.part.* > "$model"
    echo "$sha  $model" | sha256sum -c -
    # The perplexity test reads the Apache-2.0 text where Debian and Ubuntu keep it.
    test -f /usr/share/common-licenses/Apache-2.0 ||
      { echo "no /usr/share/common-licenses/Apache-2.0 here: carry it and copy it there" >&2; exit 1; }
    for cores in 1 0; do
      echo "== NPU_HAL_TENSOR_CORES=$cores"
      NPU_HAL_TENSOR_CORES=$cores SMOLLM2_GGUF=$model "$bin" --ignored --test-threads=1 \
        --nocapture smollm2_gpu
    done
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
