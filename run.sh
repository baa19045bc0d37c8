#!/usr/bin/env bash
# Set up (venv + the package and its runtime dependencies, no test or dev tools) and start
# buildvault with its defaults: local disk, no S3, gRPC on 127.0.0.1:9092, HTTP on
# 127.0.0.1:8080. Extra arguments go to `buildvault serve`.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/setup-venv.sh >&2
exec "${BUILDVAULT_VENV:-.venv}/bin/buildvault" serve "$@"
