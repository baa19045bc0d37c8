#!/usr/bin/env bash
# Set up everything the tests need (Debian packages, venv with the test and dev extras), run the
# lint and type gate (scripts/lint.sh: ruff, mypy), then every test. Extra arguments go to pytest.
# BUILDVAULT_LINT=0 skips the gate for a quick local run of a few tests; CI never sets it.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/install-system-deps.sh
./scripts/setup-venv.sh test,dev
if [ "${BUILDVAULT_LINT:-1}" != 0 ]; then
  ./scripts/lint.sh
fi
exec "${BUILDVAULT_VENV:-.venv}/bin/python" -m pytest -p no:cacheprovider -q "$@"
