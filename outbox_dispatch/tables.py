"""Plain aligned text tables, for the CLI and the reports of the demo, bench and chaos runs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table; values are shown with str()."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    text = str(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."
