"""A csrc-like operator tree, generated: 40 operators in 8 families, 147 compiles.

Shape (as the real csrc tree): a third-party static library, a common library every operator
uses, one static library per operator family with the family's shared headers (types, tiling,
kernel API) and per operator a host, a kernel and a tiling source, plus one executable.
"""

from __future__ import annotations

from pathlib import Path

STD = "#include <array>\n#include <cstdint>\n#include <cstring>\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _body(name: str, header: str) -> str:
    """About 90 headers read per compile (the standard ones included), a small function."""
    return (
        f'#include "{header}"\n{STD}\n'
        f"int64_t {name}_fold(const std::array<int64_t, 8>& shape) {{\n"
        f'  int64_t acc = 0;\n  for (auto x : shape) acc += x;\n  return acc + std::strlen("{name}");\n}}\n'
    )


def generate(root: Path, operators: int = 40, families: int = 8) -> int:
    """Write the tree under root; returns the number of compiles it has."""
    compiles = 0
    cmake = [
        "cmake_minimum_required(VERSION 3.16)",
        "project(csrc_large CXX)",
        "set(CMAKE_CXX_STANDARD 17)",
        "if(NOT CMAKE_BUILD_TYPE)\n  set(CMAKE_BUILD_TYPE Release)\nendif()",
    ]
    tp = [f"third_party/src/tp_{i}.cc" for i in range(5)]
    _write(root / "third_party/include/tinyfmt/fmt.h", f"#pragma once\n{STD}int64_t tp_join();\n")
    for i, src in enumerate(tp):
        _write(root / src, _body(f"tp{i}", "tinyfmt/fmt.h"))
    cmake += [f"add_library(tinyfmt STATIC {' '.join(tp)})",
              "target_include_directories(tinyfmt PUBLIC third_party/include)"]  # fmt: skip
    common = [f"common/src/common_{i}.cc" for i in range(5)]
    _write(root / "common/include/common/registry.h",
           f"#pragma once\n{STD}void register_op(const char*);\n")  # fmt: skip
    for i, src in enumerate(common):
        _write(root / src, _body(f"common{i}", "common/registry.h"))
    cmake += [f"add_library(op_common STATIC {' '.join(common)})",
              "target_include_directories(op_common PUBLIC common/include)",
              "target_link_libraries(op_common PUBLIC tinyfmt)"]  # fmt: skip
    compiles += len(tp) + len(common)
    libs = []
    for f in range(families):
        family = f"family{f}"
        inc = root / family / "include" / family
        shape = f"struct {family}_shape {{ int64_t d[8]; }};\n"
        _write(inc / "types.h", f'#pragma once\n{STD}#include "common/registry.h"\n{shape}')
        tiling = f"struct {family}_tiling {{ int64_t block; }};\n"
        _write(inc / "tiling.h", f'#pragma once\n#include "{family}/types.h"\n{tiling}')
        _write(inc / "kernel_api.h", f'#pragma once\n#include "{family}/tiling.h"\nvoid {family}_launch();\n')
        sources = [f"{family}/common.cc", f"{family}/utils.cc"]
        _write(root / sources[0], _body(f"{family}_common", f"{family}/types.h"))
        _write(root / sources[1], _body(f"{family}_utils", f"{family}/tiling.h"))
        for op in range(f, operators, families):
            name = f"op{op:02d}"
            base = f"{family}/ops/{name}"
            _write(root / base / f"{name}.h", f'#pragma once\n#include "{family}/types.h"\nvoid {name}_host();\n')
            for part, header in (("host", f"{name}.h"), ("kernel", f"{family}/kernel_api.h"),
                                 ("tiling", f"{family}/tiling.h")):  # fmt: skip
                _write(root / base / f"{part}.cc", _body(f"{name}_{part}", header))
                sources.append(f"{base}/{part}.cc")
        cmake += [f"add_library({family} STATIC {' '.join(sources)})",
                  f"target_include_directories({family} PUBLIC {family}/include)",
                  f"target_link_libraries({family} PUBLIC op_common)"]  # fmt: skip
        libs.append(family)
        compiles += len(sources)
    _write(root / "main.cc", _body("main_entry", "common/registry.h") + "int main() { return 0; }\n")
    cmake += ["add_executable(csrc_demo main.cc)", f"target_link_libraries(csrc_demo {' '.join(libs)})"]
    compiles += 1
    _write(root / "CMakeLists.txt", "\n".join(cmake) + "\n")
    return compiles
