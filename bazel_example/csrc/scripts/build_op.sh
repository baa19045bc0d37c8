#!/bin/sh
# Operator build step (stand-in for a generated Ascend C build script):
#   build_op.sh OP_DIR OUT_DIR
# writes OUT_DIR/<op>.o, <op>.json, <op>_tiling.bin and the symlink <op>.kernel -> <op>.o.
# SOC and OP_BUILD_MODE come from the environment (buildvault_cached_command ENV).
set -e
op_dir=$1
out=$2
op=$(basename "$op_dir")
mkdir -p "$out"
if [ -n "$OP_STEP_LOG" ]; then echo "$op" >> "$OP_STEP_LOG"; fi
cat "$op_dir"/op_kernel/*.cc | tr 'a-z' 'A-Z' > "$out/$op.o"
cat "$op_dir"/op_host/*_tiling.h | cksum > "$out/${op}_tiling.bin"
printf '{"op": "%s", "soc": "%s", "mode": "%s"}\n' "$op" "${SOC:-unset}" "${OP_BUILD_MODE:-release}" > "$out/$op.json"
ln -sf "$op.o" "$out/$op.kernel"
echo "built operator $op for ${SOC:-unset}"
