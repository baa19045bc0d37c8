"""How admin commands show what they do: a rich progress bar on a terminal, nothing otherwise;
then one plain summary line, or with --json one JSON object on stdout for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from buildvault.config import format_size


class Advance(Protocol):
    def __call__(self, steps: int = 1, total: int | None = None) -> None: ...


@contextmanager
def progress(label: str, total: int | None, enabled: bool, stream: IO[str] | None = None) -> Iterator[Advance]:
    """Yields `advance(steps, total=None)`; draws a bar on stderr only when `enabled` and it is a terminal."""
    stream = stream or sys.stderr
    if not enabled or not stream.isatty():

        def nothing(steps: int = 1, total: int | None = None) -> None:
            return None

        yield nothing
        return
    console = Console(file=stream)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)

        def advance(steps: int = 1, total: int | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            bar.advance(task, steps)

        yield advance


def emit(summary: str, document: dict[str, Any], as_json: bool, stream: IO[str] | None = None) -> None:
    """The command's result: `document` as JSON, or the one-line `summary`."""
    stream = stream or sys.stdout
    if as_json:
        stream.write(json.dumps(document, sort_keys=True) + "\n")
    else:
        stream.write(summary + "\n")
    stream.flush()


def human_bytes(value: int | float | None) -> str:
    if value is None:
        return "-"
    return format_size(float(value))
