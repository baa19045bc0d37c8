#!/usr/bin/env bash
# Create .venv and install buildvault with its test and dev extras (idempotent, quiet).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test,dev]'
  rm -f .venv/.installed-* && touch "$stamp"
fi
