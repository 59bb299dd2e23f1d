#!/usr/bin/env bash
# Issue 21: the tensor-core GEMM's blockings on the device machine, one vit_bench run per
# blocking and batch, rounds alternating so that clock drift falls on every blocking alike.
#
#   benches/h200/gemm_tiles.sh VIT_BENCH ROUNDS TILE...
#
# TILE is a `VIT_COOP_TILE` value (`ROWSxCOLS/TMxTN[/pN][/pairs]`, one blocking forced on every
# GEMM of the tower) or `default` (CoopTile::for_shape's pick per GEMM), optionally followed by
# `+ARG` for more vit_bench arguments (`default+split:4`: the residual GEMMs split over k in 4).
# Each run is `vit_bench b16-512 gpu 20 coop tiled batch:N profile [ARG...]` at batch 1 and 8;
# one JSON line per run on stdout, with the round and the tile added. VIT_BENCH is a release
# build of the example (benches/h200/encoder_vs_torch.sh says how). The /v16 rows of
# 2026-12-07-gemm-tiles.log are of a build of 6197ebb, whose blockings also took `/v16`
# (16-byte loads; slower, removed).
set -uo pipefail
bench=${1:?usage: gemm_tiles.sh VIT_BENCH ROUNDS TILE...}
rounds=${2:?usage: gemm_tiles.sh VIT_BENCH ROUNDS TILE...}
shift 2
for round in $(seq "$rounds"); do
  for tile in "$@"; do
    IFS=+ read -r blocking extra <<< "$tile"
    for batch in 1 8; do
      forced=()
      [ "$blocking" = default ] || forced=("VIT_COOP_TILE=$blocking")
      # shellcheck disable=SC2086
      line=$(env -u VIT_COOP_TILE "${forced[@]}" "$bench" b16-512 gpu 20 coop tiled "batch:$batch" profile ${extra//+/ } 2>/dev/null | tail -1)
      echo "{\"round\": $round, \"tile\": \"$tile\", \"run\": ${line:-null}}"
    done
  done
done
