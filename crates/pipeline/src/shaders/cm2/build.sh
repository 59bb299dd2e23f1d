#!/usr/bin/env bash
# Compiles the GLSL of this directory to the SPIR-V that `pipeline::cm2` loads through wgpu's
# passthrough (naga has no NV cooperative matrices 2), and records each module's source hash
# and flags in SOURCES.sha256, which `cm2_spirv_is_built_from_its_sources` checks.
#
#   GLSLANG=glslangValidator crates/pipeline/src/shaders/cm2/build.sh
#
# Needs glslang 15 or newer (GL_NV_cooperative_matrix2). Debian bookworm's is 11; the modules
# committed here were made with trixie's glslang-tools 15.1.0+1.4.309.0-1 (glslang 15.2.0).
set -euo pipefail
cd "$(dirname "$0")"
glslang=${GLSLANG:-glslangValidator}
# name, source, flags
modules=(
  "gemm_plain gemm_plain.comp"
  "gemm_cm2_64x64x64_w128 gemm_cm2.comp -DBM=64 -DBN=64 -DBK=64 -DWG=128"
  "gemm_cm2_128x128x64_w256 gemm_cm2.comp -DBM=128 -DBN=128 -DBK=64 -DWG=256"
  "gemm_cm2_128x256x64_w256 gemm_cm2.comp -DBM=128 -DBN=256 -DBK=64 -DWG=256"
)
: > SOURCES.sha256
for m in "${modules[@]}"; do
  read -r name source flags <<< "$m"
  # shellcheck disable=SC2086
  "$glslang" --target-env vulkan1.3 $flags -o "$name.spv" "$source" > /dev/null
  echo "$(sha256sum "$source" | cut -c1-64) $name $source $flags" >> SOURCES.sha256
done
