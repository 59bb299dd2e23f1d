#!/usr/bin/env bash
# Issue 15's real-model checks on the device machine: the GPU decoder on SmolLM2-135M-Instruct
# (Q4_1 GGUF) against the CPU NPU, with the tensor-core prefill GEMM on (the H200's default)
# and off. The machine has no network and one call carries at most 64 MiB, so the 98 MB model
# travels xz-compressed (86 MiB) in two parts over consecutive calls to a warm machine, which
# keeps /tmp between them (a machine goes back 30 s after a call: send the next one at once).
#
# Here (this repository's machine; .h200a and .h200b are listed in .git/info/exclude):
#   xz -T2 -6 -c models/SmolLM2-135M-Instruct.Q4_1.gguf | split -b 50M -d - .h200a/smollm2.xz.
#   mv .h200a/smollm2.xz.01 .h200b/
#   cargo test --release -p pipeline --all-features --test smollm2 --no-run   # prints the binary
#   strip -o .h200b/smollm2 target/release/deps/smollm2-HASH && xz -T2 .h200b/smollm2
# Then one device call per part (carry .gl and the part's folder):
#   bash benches/h200/smollm2_checks.sh stash .h200a/smollm2.xz.00
#   bash benches/h200/smollm2_checks.sh run .h200b/smollm2.xz [.h200b/smollm2.xz.01]
# `run` joins the parts, decompresses them, checks the model's SHA-256 and runs the test
# binary's GPU tests twice, NPU_HAL_TENSOR_CORES=1 and =0, with CI=true (a test that finds no
# GPU then fails instead of passing with a SKIPPED line); their output (max and mean logit
# error, greedy ids agreeing, both perplexities) is the record. The model is left at
# /tmp/SmolLM2-135M-Instruct.Q4_1.gguf for whatever the call runs next. The CPU-only tests of
# that binary read fixtures at this checkout's absolute path and are not run there; CI runs
# them here.
set -euo pipefail
store=/tmp/smollm2-parts
model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# Debian's /usr/share/common-licenses/Apache-2.0, byte for byte this repository's LICENSE-APACHE.
apache_sha=cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30
here=$(cd "$(dirname "$0")/../.." && pwd)
mode=${1:?usage: smollm2_checks.sh stash PART... | run TEST_BIN[.xz] [PART...]}
shift
mkdir -p "$store"
unxz_to() { # FILE.xz OUT: xz where installed, else Python's lzma
  if command -v xz >/dev/null; then xz -dc "$1" > "$2"
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$1" "$2"; fi
}
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
    if [[ $bin == *.xz ]]; then unxz_to "$bin" /tmp/smollm2-tests; chmod +x /tmp/smollm2-tests; bin=/tmp/smollm2-tests; fi
    cat "$store"/smollm2.xz.* > /tmp/smollm2.gguf.xz
    unxz_to /tmp/smollm2.gguf.xz "$model"
    echo "$sha  $model" | sha256sum -c -
    # The perplexity test reads the Apache-2.0 text where Debian and Ubuntu keep it.
    licence=/usr/share/common-licenses/Apache-2.0
    if [ ! -f $licence ]; then
      echo "$apache_sha  $here/LICENSE-APACHE" | sha256sum -c - >/dev/null
      mkdir -p "$(dirname $licence)" && cp "$here/LICENSE-APACHE" $licence
      echo "no $licence here: copied LICENSE-APACHE, the same bytes"
    fi
    echo "$apache_sha  $licence" | sha256sum -c -
    for cores in 1 0; do
      echo "== NPU_HAL_TENSOR_CORES=$cores"
      CI=true NPU_HAL_TENSOR_CORES=$cores SMOLLM2_GGUF=$model "$bin" --ignored --test-threads=1 \
        --nocapture smollm2_gpu
    done
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
