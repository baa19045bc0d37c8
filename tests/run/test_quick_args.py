"""The quick pre-parser of `buildvault run` agrees with argparse, and declines what it cannot mirror."""

from __future__ import annotations

import argparse

import pytest

from buildvault.client.run.command import add_run_parser
from buildvault.client.run.quick_args import quick_parse


def argparse_parse(argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="buildvault run")
    add_run_parser(parser.add_subparsers(dest="command"))
    return vars(parser.parse_args(["run", *argv]))


AGREE = [
    ["--output", "out", "--", "./step.sh", "a", "--input", "x"],
    [
        "--name",
        "op",
        "--input",
        "a",
        "--input=b",
        "--env",
        "A=1",
        "--env=B=-2",
        "--writer",
        "--output-dir",
        "o",
        "--",
        "cmd",
    ],
    ["--no-writer", "--lock-timeout", "2.5", "--remote", "grpc://h:1", "--instance", "i", "--output", "x", "cmd", "-v"],
    [
        "--exclude",
        "*.o",
        "--tool",
        "cc",
        "--toolchain-file",
        "t",
        "--platform",
        "soc=a,cann=b",
        "--normalize-root",
        "SDK=/opt",
        "--recipe-file",
        "r.sh",
        "--recipe-value",
        "O2",
        "--workdir",
        "w",
        "--output",
        "o",
        "--",
        "x",
    ],
    ["--output", "o", "--", "--"],
]
DECLINE = [
    ["--out", "o", "--", "cmd"],  # an abbreviation
    ["--help"],
    ["--summary", "log"],
    ["--recipe-value", "-O2", "--output", "o", "--", "cmd"],
    ["--lock-timeout", "soon", "--output", "o", "--", "cmd"],
    ["--output", "o"],  # no command
    ["--output"],
    ["-x", "--", "cmd"],
]


@pytest.mark.parametrize("argv", AGREE)
def test_quick_parse_agrees_with_argparse(argv: list[str]) -> None:
    quick = quick_parse(argv)
    assert quick is not None
    assert vars(quick) == argparse_parse(argv)


@pytest.mark.parametrize("argv", DECLINE)
def test_quick_parse_declines_what_argparse_must_judge(argv: list[str]) -> None:
    assert quick_parse(argv) is None
