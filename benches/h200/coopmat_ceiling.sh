#!/usr/bin/env bash
# Issue 21: what Vulkan's KHR cooperative matrices reach on this driver at the encoder's GEMM
# shapes, as a ceiling for `gemm_coop` (vision_gpu) that does not depend on our kernel. It runs
# NVIDIA's vk_cooperative_matrix_perf (MIT, github.com/jeffbolznv/vk_cooperative_matrix_perf,
# built at cc3f225 with coopmat_ceiling-mnk.patch, which adds `--mnk=M,N,K`): its
# shared-memory kernel (`--shmem`), f16 x f16 -> f32, B column-major as our weights are (w is
# n x k, row-major), every tile size it tries; this prints the best per shape.
#
#   benches/h200/coopmat_ceiling.sh build SRC INCLUDE   # SRC: a checkout; INCLUDE: Vulkan-Headers'
#                                                       # include/ (1.4.x); needs g++, libvulkan.so.1
#   benches/h200/coopmat_ceiling.sh run SRC             # on the device: one line per shape
#
# Shapes: SigLIP-B/16-512's QKV, O, fc1 and fc2 at batch 1 (m = 1024) and 8 (m = 8192), and
# 4096^3 (the tool's default size).
set -euo pipefail
mode=${1:?usage: coopmat_ceiling.sh build SRC INCLUDE | run SRC}
src=${2:?usage: coopmat_ceiling.sh build SRC INCLUDE | run SRC}
case "$mode" in
  build)
    include=${3:?usage: coopmat_ceiling.sh build SRC INCLUDE}
    if ! grep -q -e '--mnk=' "$src/src/vk_cooperative_matrix_perf.cpp"; then
      patch -d "$src" -p1 < "$(dirname "$0")/coopmat_ceiling-mnk.patch"
    fi
    g++ -O2 -std=c++17 -I"$include" "$src/src/vk_cooperative_matrix_perf.cpp" \
      /usr/lib/x86_64-linux-gnu/libvulkan.so.1 -static-libstdc++ -static-libgcc \
      -o "$src/vk_cooperative_matrix_perf"
    ;;
  run)
    cd "$src"  # the tool loads shaders/*.spv from the working directory
    for m in 1024 8192; do
      for nk in 2304,768 768,768 3072,768 768,3072; do
        shapes+=("$m,$nk")
      done
    done
    shapes+=(4096,4096,4096)
    for shape in "${shapes[@]}"; do
      timeout 60 ./vk_cooperative_matrix_perf --shmem --mnk="$shape" 2>&1 | awk -v shape="$shape" '
        /cooperativeMatrixProps/ { ours = /A = float16_t B = float16_t C = float32_t D = float32_t/ }
        ours && /BColMajor=1/ && /TFlops/ {
          for (i = 1; i <= NF; i++) if ($(i + 1) == "TFlops") t = $i
          if (t + 0 > best) { best = t + 0; line = $0 }
        }
        END { printf "%s: %s TFLOP/s (%s)\n", shape, best ? best : "none", line }' ||
        echo "$shape: vk_cooperative_matrix_perf failed or timed out"
    done
    ;;
  *) echo "usage: coopmat_ceiling.sh build SRC INCLUDE | run SRC" >&2; exit 2 ;;
esac
