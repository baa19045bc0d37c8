"""Server-drawn SVG line charts for the status page (no script, no CDN: works offline).

`charts(samples)` turns the History ring buffer into four small charts: AC hit ratio per
interval, CAS bytes in and out per second, disk use against the cap, and the upload backlog.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from buildvault.server.history import Sample

WIDTH, HEIGHT, PAD = 360, 120, 28
LEFT = 52  # room for the y-axis labels
COLORS = ("#2b7bb9", "#d9822b", "#888")


def _points(values: Sequence[float], top: float) -> str:
    n = len(values)
    span = max(top, 1e-9)
    step = (WIDTH - LEFT - PAD) / max(1, n - 1)
    inner = HEIGHT - 2 * PAD
    base = HEIGHT - PAD
    return " ".join(f"{LEFT + i * step:.1f},{base - inner * min(v, span) / span:.1f}" for i, v in enumerate(values))


def line_chart(title: str, series: Sequence[tuple[str, Sequence[float]]], unit: str, top: float | None = None) -> str:
    """One chart; `series` is (label, values) in draw order; `top` fixes the y range (else the max)."""
    peak = top if top is not None else max((max(v) for _, v in series if v), default=0.0)
    peak = peak or 1.0
    lines = [
        f'<polyline class="series" data-label="{html.escape(label)}" data-points="{len(values)}" fill="none" '
        f'stroke="{COLORS[i % len(COLORS)]}" stroke-width="2" points="{_points(values, peak)}"/>'
        for i, (label, values) in enumerate(series)
        if values
    ]
    legend = " ".join(
        f'<tspan fill="{COLORS[i % len(COLORS)]}">■ {html.escape(label)}</tspan>' for i, (label, _) in enumerate(series)
    )
    return (
        f'<figure class="chart"><svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{html.escape(title)}">'
        f'<text x="{LEFT}" y="16" font-size="12" font-weight="600">{html.escape(title)}</text>'
        f'<text x="{WIDTH - PAD}" y="16" font-size="11" text-anchor="end">{legend}</text>'
        f'<line x1="{LEFT}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#ccc"/>'
        f'<text x="{LEFT - 4}" y="{PAD + 4}" font-size="10" text-anchor="end">{html.escape(_short(peak, unit))}</text>'
        f'<text x="{LEFT - 4}" y="{HEIGHT - PAD}" font-size="10" text-anchor="end">0</text>'
        + "".join(lines)
        + "</svg></figure>"
    )


def _short(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.0f}%"
    for suffix in ("", "K", "M", "G", "T"):
        if abs(value) < 1000 or suffix == "T":
            return f"{value:.3g}{suffix}{unit}"
        value /= 1000
    return f"{value:.3g}{unit}"  # pragma: no cover


def _rates(samples: Sequence[Sample], field: str) -> list[float]:
    rates: list[float] = []
    for before, after in zip(samples, samples[1:], strict=False):
        seconds = max(after.time - before.time, 1e-3)
        rates.append(max(0.0, (getattr(after, field) - getattr(before, field)) / seconds))
    return rates


def _hit_ratios(samples: Sequence[Sample]) -> list[float]:
    ratios: list[float] = []
    for before, after in zip(samples, samples[1:], strict=False):
        hits, misses = after.ac_hits - before.ac_hits, after.ac_misses - before.ac_misses
        # An interval without lookups repeats the last ratio (no lookups is no news).
        ratios.append(100.0 * hits / (hits + misses) if hits + misses else (ratios[-1] if ratios else 0.0))
    return ratios


def charts(samples: Sequence[Sample]) -> str:
    """The status page's charts as HTML (empty series until two samples exist)."""
    used = [float(s.used_bytes or 0) for s in samples]
    cap = [float(s.max_bytes or 0) for s in samples]
    backlog = [float(s.upload_backlog or 0) for s in samples]
    return "\n".join(
        [
            line_chart("AC hit ratio", [("hits", _hit_ratios(samples))], "%", top=100.0),
            line_chart(
                "CAS bytes/s", [("in", _rates(samples, "bytes_in")), ("out", _rates(samples, "bytes_out"))], "B/s"
            ),
            line_chart("Disk use", [("used", used), ("cap", cap)], "B"),
            line_chart("Upload backlog", [("entries", backlog)], ""),
        ]
    )
