"""The CI gate: scripts/lint.sh fails on a lint or a type error with the project's settings, and
`.ci/run` fails when pytest ran no test (its exit 5), as when a path or -k selects nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

CLEAN = '''\
"""A module that passes the gate."""

from __future__ import annotations

import json
import sys


def dump(values: dict[str, int]) -> None:
    json.dump(values, sys.stdout)
'''


def _lint(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO_ROOT / "scripts" / "lint.sh"), *map(str, paths)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _module(tmp_path: Path, name: str, text: str) -> Path:
    # ruff reads the settings nearest the file: give the temporary module the project's own.
    shutil.copy2(REPO_ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_lint_passes_a_clean_module(tmp_path: Path) -> None:
    proc = _lint(_module(tmp_path, "clean.py", CLEAN))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lint_fails_on_a_ruff_finding(tmp_path: Path) -> None:
    # Imports out of order (I001) and a 121-character line (E501): both selected in pyproject.
    unsorted = CLEAN.replace("import json\nimport sys\n", "import sys\nimport json\n")
    long_line = '\nBANNER = "' + "x" * 110 + '"\n'  # 121 characters
    proc = _lint(_module(tmp_path, "unsorted.py", unsorted + long_line))
    assert proc.returncode != 0
    assert "I001" in proc.stdout and "E501" in proc.stdout, proc.stdout + proc.stderr


def test_lint_fails_on_a_type_error_ruff_accepts(tmp_path: Path) -> None:
    mistyped = CLEAN + '\n\ndef count(values: dict[str, int]) -> int:\n    return str(len(values))\n'
    untyped = CLEAN + "\n\ndef size(values):\n    return len(values)\n"
    proc = _lint(_module(tmp_path, "mistyped.py", mistyped), _module(tmp_path, "untyped.py", untyped))
    assert proc.returncode != 0
    assert "mistyped.py:14: error" in proc.stdout and "[return-value]" in proc.stdout, proc.stdout + proc.stderr
    assert "untyped.py:13: error" in proc.stdout and "[no-untyped-def]" in proc.stdout, proc.stdout + proc.stderr


def test_ci_run_fails_when_no_test_ran() -> None:
    env = {**os.environ, "BUILDVAULT_LINT": "0"}
    proc = subprocess.run(
        [str(REPO_ROOT / ".ci" / "run"), "tests/unit/test_digest.py", "-k", "no_test_is_called_this"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "deselected" in proc.stdout, proc.stdout
