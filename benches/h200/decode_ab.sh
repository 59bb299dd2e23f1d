#!/usr/bin/env bash
# Two builds of `pipeline` on the device machine, alternating, on the SmolLM2-shaped random model
# (`smollm2_shape.py`): `pipeline bench --device gpu --n-prompt 512 --n-gen 128 --reps 6`, one
# JSON file per run under $OUT and one summary line per test (median tokens/s and the bench's
# per-token split). A warm-up run first writes the converted-weight cache, so no timed process
# converts weights (the first process of 2026-12-07's first call, which did, prefilled 4.5x
# slower; not diagnosed).
#
#   benches/h200/decode_ab.sh OLD_PIPELINE NEW_PIPELINE [ROUNDS]
#
# Both are release builds from this machine (`cargo build --release -p pipeline --bin
# pipeline`, stripped; xz them to carry more in one call). Written for issue 15's
# `Device::row_argmax` A/B (the peer: the build before it); run on an H100 on 2026-12-07
# (results/2026-12-07-decode-ab-h100.log), not yet on the H200.
set -uo pipefail
old=${1:?usage: decode_ab.sh OLD_PIPELINE NEW_PIPELINE [ROUNDS]}
new=${2:?usage: decode_ab.sh OLD_PIPELINE NEW_PIPELINE [ROUNDS]}
rounds=${3:-3}
here=$(dirname "$0")
out=${OUT:-/tmp}
model=/tmp/smollm2-shape
[ -f $model/config.json ] || python3 "$here/smollm2_shape.py" $model > /dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
"$old" bench --model $model --device gpu --n-prompt 64 --n-gen 16 --reps 1 > /dev/null 2>&1
for round in $(seq "$rounds"); do
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    json="$out/bench_${side}_$round.json"
    "$bin" bench --model $model --device gpu --n-prompt 512 --n-gen 128 --reps 6 2>/dev/null > "$json"
    python3 - "$json" $side $round <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    split = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r["split"].items()}
    print(sys.argv[2], sys.argv[3], r["test"], round(r["median_ts"], 1), split)
PY
  done
done
