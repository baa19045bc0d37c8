"""A strict pre-parser for the common `buildvault run` command line, so the per-step front does
not import argparse (~40 ms with re, enum and gettext).

It accepts only spellings whose meaning under the real parser (spec.add_arguments) is plain:
`--option VALUE`, `--option=VALUE`, `--writer`/`--no-writer`, then `--` (or the first word
that is not an option) and the command. Anything else (an abbreviation, --help, --summary, a
value that starts with `-`, a bad number) returns None and the caller parses with argparse,
which gives the usual error. tests/run/test_quick_args.py checks both parsers agree.
"""

from __future__ import annotations

import types

# option -> (attribute, repeatable)
_VALUED = {
    "--name": ("name", False),
    "--input": ("input", True),
    "--exclude": ("exclude", True),
    "--recipe-file": ("recipe_file", True),
    "--recipe-value": ("recipe_value", True),
    "--env": ("env", True),
    "--tool": ("tool", True),
    "--toolchain-file": ("toolchain_file", True),
    "--platform": ("platform", True),
    "--normalize-root": ("normalize_root", True),
    "--workdir": ("workdir", False),
    "--output": ("output", True),
    "--output-dir": ("output_dir", False),
    "--remote": ("remote", False),
    "--instance": ("instance", False),
    "--lock-timeout": ("lock_timeout", False),
}
_DEFAULTS: dict[str, object] = {
    "name": "",
    "input": [],
    "exclude": None,
    "recipe_file": [],
    "recipe_value": [],
    "env": [],
    "tool": [],
    "toolchain_file": [],
    "platform": [],
    "normalize_root": [],
    "workdir": None,
    "output": [],
    "output_dir": None,
    "remote": None,
    "instance": None,
    "writer": None,
    "lock_timeout": None,
    "summary": None,
    "command": "run",
}


def quick_parse(argv: list[str]) -> types.SimpleNamespace | None:
    """What argparse would give for `buildvault run ARGV`, or None: parse it with argparse."""
    values: dict[str, object] = {k: (list(v) if isinstance(v, list) else v) for k, v in _DEFAULTS.items()}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--" or not word.startswith("-"):
            values["step_command"] = argv[i:]
            return types.SimpleNamespace(**values)
        if word in ("--writer", "--no-writer"):
            values["writer"] = word == "--writer"
            i += 1
            continue
        option, sep, value = word.partition("=")
        if option not in _VALUED:
            return None
        if not sep:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            i += 1
        if value.startswith("-") or (not sep and not value):
            return None  # argparse's rules for these differ by case: let it decide
        i += 1
        attr, repeatable = _VALUED[option]
        if attr == "lock_timeout":
            try:
                values[attr] = float(value)
            except ValueError:
                return None
        elif repeatable:
            current = values[attr]
            values[attr] = [*current, value] if isinstance(current, list) else [value]
        else:
            values[attr] = value
    return None  # no command: argparse gives the error
