"""bench/csrc_tree.py: the generated tree has the shape launcher_bench.py --tree large promises
(40 operators in 8 families, 147 compiles, every source in the CMake file, headers per family)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import csrc_tree  # noqa: E402


def test_the_tree_has_147_compiles_all_listed(tmp_path: Path) -> None:
    compiles = csrc_tree.generate(tmp_path)
    sources = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.cc"))
    assert compiles == len(sources) == 147
    listed = set(re.findall(r"[\w/]+\.cc", (tmp_path / "CMakeLists.txt").read_text()))
    assert listed == set(sources)
    operators = {p.parent.name for p in tmp_path.glob("family*/ops/*/host.cc")}
    assert len(operators) == 40
    for family in range(8):
        headers = {p.name for p in (tmp_path / f"family{family}" / "include" / f"family{family}").iterdir()}
        assert headers == {"types.h", "tiling.h", "kernel_api.h"}
