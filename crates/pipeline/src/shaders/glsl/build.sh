#!/usr/bin/env bash
# Compiles the GLSL of this directory to the SPIR-V that `pipeline::vision_gpu` loads through
# wgpu's passthrough (naga's WGSL cannot reach a cooperative matrix's elements), validates it,
# and records each module's source hash and flags in SOURCES.sha256, which
# `glsl_spirv_is_built_from_its_sources` checks.
#
#   GLSLANG=glslangValidator SPIRV_VAL=spirv-val crates/pipeline/src/shaders/glsl/build.sh
#
# Needs glslang 13 or newer (GL_KHR_cooperative_matrix). Debian bookworm's is 11; the modules
# committed here were made with trixie's glslang-tools 15.1.0+1.4.309.0-1 (glslang 15.2.0) and
# validated with its spirv-tools 2025.1~rc1-1.
set -euo pipefail
cd "$(dirname "$0")"
glslang=${GLSLANG:-glslangValidator}
spirv_val=${SPIRV_VAL:-spirv-val}
# name, source, flags
modules=(
  "attention_fragments attention_fragments.comp -DQSUB=4"
  "fragment_probe fragment_probe.comp"
)
: > SOURCES.sha256
for m in "${modules[@]}"; do
  read -r name source flags <<< "$m"
  # shellcheck disable=SC2086
  "$glslang" --target-env vulkan1.3 $flags -o "$name.spv" "$source" > /dev/null
  "$spirv_val" --target-env vulkan1.3 "$name.spv"
  echo "$(sha256sum "$source" | cut -c1-64) $name $source $flags" >> SOURCES.sha256
done
