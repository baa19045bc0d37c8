#!/usr/bin/env bash
# Create the venv and install buildvault into it (editable), idempotent and quiet.
#
#   scripts/setup-venv.sh            the server and its runtime dependencies only (run.sh)
#   scripts/setup-venv.sh test,dev   plus the named extras from pyproject.toml (test.sh)
#
# The venv is .venv beside pyproject.toml, or $BUILDVAULT_VENV. A stamp per extras set and
# pyproject.toml content skips pip when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [[ ! "$extras" =~ ^[a-z,]*$ ]]; then
  echo "setup-venv: extras must be a comma-separated list of names, got '$extras'" >&2
  exit 2
fi
venv="${BUILDVAULT_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
label="${extras:-server}"
label="${label//,/-}"
stamp="$venv/.installed-$label-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  spec="."
  if [ -n "$extras" ]; then
    spec=".[$extras]"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$spec"
  rm -f "$venv/.installed-$label-"* && touch "$stamp"
fi
# The editable install leaves bytecode to the first import, which PYTHONDONTWRITEBYTECODE=1 (set
# on some machines) prevents: every `buildvault run` / buildvault-cc start would then compile its
# modules again (about 30 ms). Compiling here is what a wheel install does; stale files recompile.
"$venv/bin/python" -m compileall -q src/buildvault >/dev/null
