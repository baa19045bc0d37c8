#!/usr/bin/env bash
# The lint and type gate test.sh runs before pytest (settings in pyproject.toml):
# ruff over src, tests and bench; mypy (strict) over src/buildvault.
# Arguments replace the default paths: `scripts/lint.sh PATH...` runs ruff on all of them and
# mypy on those outside tests/ and bench/ (which are held to ruff only).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${BUILDVAULT_VENV:-.venv}"
if [ "$#" -gt 0 ]; then
  ruff_paths=("$@")
  mypy_paths=()
  for path in "$@"; do
    case "$(realpath -m --relative-to=. "$path")" in
      tests | tests/* | bench | bench/*) ;;
      *) if [ -d "$path" ] || [[ "$path" == *.py ]] || [[ "$path" == *.pyi ]]; then mypy_paths+=("$path"); fi ;;
    esac
  done
else
  ruff_paths=(src tests bench)
  mypy_paths=()  # pyproject.toml's [tool.mypy] files
fi
# pytest's default import mode keeps one module per basename: two test files of one name in
# different tests/ folders stop the whole suite at collection ("import file mismatch").
duplicates="$(find tests -name '*.py' ! -name conftest.py -printf '%f\n' | sort | uniq -d)"
if [ -n "$duplicates" ]; then
  echo "lint: test modules must have unique basenames across tests/; duplicated:" $duplicates >&2
  exit 1
fi
echo "lint: ruff check ${ruff_paths[*]}"
"$venv/bin/ruff" check --quiet "${ruff_paths[@]}"
if [ "$#" -gt 0 ] && [ ${#mypy_paths[@]} -eq 0 ]; then
  exit 0
fi
echo "lint: mypy ${mypy_paths[*]:-(pyproject files)}"
"$venv/bin/mypy" "${mypy_paths[@]}"
