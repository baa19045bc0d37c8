"""`buildvault-cc --summary LOG...`: totals from BUILDVAULT_EVENT_LOG files. Stdlib only."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any


def summarize(lines: Iterable[str]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    saved = 0.0
    seconds = 0.0
    compile_seconds = 0.0
    outputs = 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        status = event.get("status", "?")
        counts[status] += 1
        if status != "HIT":
            reasons[f"{status}:{event.get('reason', '')}"] += 1
        seconds += float(event.get("seconds") or 0.0)
        saved += float(event.get("saved") or 0.0)
        compile_seconds += float(event.get("compile_seconds") or 0.0)
        if status == "HIT":
            outputs += int(event.get("outputs") or 0)
    cacheable = counts["HIT"] + counts["MISS"]
    return {
        "actions": sum(counts.values()),
        "hits": counts["HIT"],
        "misses": counts["MISS"],
        "bypassed": counts["BYPASS"],
        "hit_rate": round(counts["HIT"] / cacheable, 4) if cacheable else 0.0,
        "outputs_downloaded": outputs,
        "seconds_in_launcher": round(seconds, 3),
        "seconds_compiling_misses": round(compile_seconds, 3),
        "seconds_saved": round(saved, 3),
        "reasons": dict(reasons.most_common()),
    }


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    paths = [a for a in argv if a != "--json"]
    if not paths:
        print("usage: buildvault-cc --summary [--json] LOG...", file=sys.stderr)
        return 2
    lines: list[str] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines.extend(f)
        except OSError as e:
            print(f"buildvault-cc: {path}: {e}", file=sys.stderr)
            return 1
    s = summarize(lines)
    if as_json:
        print(json.dumps(s, indent=2))
        return 0
    print(f"actions:          {s['actions']}")
    print(f"hits:             {s['hits']}")
    print(f"misses:           {s['misses']}")
    print(f"bypassed:         {s['bypassed']}")
    print(f"hit rate:         {s['hit_rate'] * 100:.1f}% of cacheable compiles")
    print(f"time saved:       {s['seconds_saved']:.2f} s (compile time of the hits minus time to fetch them)")
    print(f"compiling misses: {s['seconds_compiling_misses']:.2f} s")
    for reason, n in s["reasons"].items():
        print(f"  {n:6d}  {reason}")
    return 0
