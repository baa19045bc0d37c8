"""`buildvault run` and `buildvault cmake-module-path`: argument handling; the work is in step.py."""

from __future__ import annotations

import os
import sys

from .spec import SpecError, add_arguments, spec_from_args

TYPE_CHECKING = False  # argparse loads only when the quick parser declines (quick_args.py)
if TYPE_CHECKING:
    import argparse
    import types
    from collections.abc import Mapping

# os.path, not pathlib: this module is imported by every `buildvault run`.
CMAKE_MODULE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))), "cmake")


def add_run_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    run = commands.add_parser(
        "run",
        help="run one build step through the cache",
        description="Run CMD as one cached build step: its key is an REAPI Action of the declared inputs, "
                    "recipe, environment and toolchain; a hit restores the outputs and replays the output.",
    )
    add_arguments(run)
    run.add_argument("--summary", nargs="+", metavar="LOG", help="print totals of BUILDVAULT_EVENT_LOG files and exit")
    commands.add_parser("cmake-module-path", help="print the directory holding buildvault.cmake")


def main_run(args: argparse.Namespace | types.SimpleNamespace, env: Mapping[str, str] | None = None) -> int:
    if args.summary:
        from ..summary import main as summary_main  # json: only the summary pays for it

        return summary_main(list(args.summary))
    env = os.environ if env is None else env
    try:
        spec = spec_from_args(args, env, os.getcwd())
    except SpecError as e:
        print(f"buildvault run: {e}", file=sys.stderr)
        return 2
    from .fast import LOOKED_UP, run_fast

    code = run_fast(spec, env)
    if code is not None:
        return code
    if sys.flags.no_site:  # started as buildvault-run-fast (python -IS): grpc lives in site-packages
        import site

        site.main()
    from .step import run_step  # the in-process path: imports the gRPC stack

    return run_step(spec, env, looked_up=bool(LOOKED_UP))


def run_main(argv: list[str]) -> int:
    """`buildvault run ARGS` parsed by its own parser (what `buildvault` does for `run`)."""
    if argv[:1] == ["--install-fast"]:
        return install_fast(argv[1] if len(argv) > 1 else None)
    from .quick_args import quick_parse

    quick = quick_parse(argv)
    if quick is not None:
        return main_run(quick)
    import argparse

    parser = argparse.ArgumentParser(prog="buildvault run")
    commands = parser.add_subparsers(dest="command")
    add_run_parser(commands)
    return main_run(parser.parse_args(["run", *argv]))


def main_cmake_module_path() -> int:
    print(CMAKE_MODULE_DIR)
    return 0 if os.path.isfile(os.path.join(CMAKE_MODULE_DIR, "buildvault.cmake")) else 1


def install_fast(directory: str | None) -> int:
    """DIR/buildvault-run-fast: `buildvault run` started as python -IS (client/fast_script.py);
    main_run enters site-packages itself before the in-process path. buildvault.cmake uses it."""
    from ..fast_script import install

    entry = "from buildvault.client.run.command import run_main\nsys.exit(run_main(sys.argv[1:]))"
    return install("buildvault-run-fast", "buildvault run --install-fast", entry, directory)
