"""Text tables and progress (rich's), for the CLI and the reports of the demo, bench and chaos
runs.

Rendered to a plain string without colour or wrapping, so a table piped into grep or a log
keeps one row per line; the values are formatted here (times, floats, long errors cut)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """An aligned text table, a header and a rule above the rows."""
    shown = Table(*columns, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for row in rows:
        shown.add_row(*(_cell(row.get(c)) for c in columns))
    out = io.StringIO()
    # wide enough never to wrap: the table is as wide as its content
    Console(file=out, width=100_000, color_system=None, highlight=False).print(shown)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines() if line.strip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, datetime):
        return value.isoformat(timespec="seconds")
    text = str(value).replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


@contextmanager
def pruning_progress(*, quiet: bool = False) -> Iterator[Callable[[str, int], None]]:
    """A ``progress(family, deleted so far)`` callback that keeps one live line per family on
    stderr (on a terminal; elsewhere the final counts, once)."""
    if quiet:
        yield lambda family, deleted: None
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("prune: {task.description}: {task.completed:,.0f} rows deleted"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def update(family: str, deleted: int) -> None:
            if family not in tasks:
                tasks[family] = bar.add_task(family, total=None)
            bar.update(tasks[family], completed=deleted)

        yield update
