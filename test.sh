#!/usr/bin/env bash
# Set up everything the tests need (Debian packages, venv, package) and run every test.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/install-system-deps.sh
./scripts/setup-venv.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -q "$@"
