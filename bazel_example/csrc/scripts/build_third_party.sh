#!/bin/sh
# A third-party CMake build as one step: configure, build, install into PREFIX.
#   build_third_party.sh SOURCE_DIR BUILD_DIR PREFIX [GENERATOR]
set -e
if [ -n "$OP_STEP_LOG" ]; then echo "third_party:$(basename "$1")" >> "$OP_STEP_LOG"; fi
rm -rf "$2" "$3"
cmake -S "$1" -B "$2" -G "${4:-Unix Makefiles}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$3" > "$2.log"
cmake --build "$2" >> "$2.log"
cmake --install "$2" >> "$2.log"
echo "installed $(basename "$1") into $(basename "$3")"
