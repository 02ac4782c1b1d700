"""Text for operators: rows aligned in columns, the first line of a long text, times."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime


def align(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as lines, each column padded to its widest cell."""
    if not rows:
        return []
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def iso(moment: datetime | None) -> str:
    """`moment` as an ISO 8601 UTC time to the second, or '-'."""
    if moment is None:
        return "-"
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def first_line(text: str | None, width: int = 80) -> str:
    """The first non-blank line of `text`, cut to `width` characters; '-' for none."""
    line = next((line.strip() for line in (text or "").splitlines() if line.strip()), "")
    if not line:
        return "-"
    line = " ".join(line.split())
    return line if len(line) <= width else f"{line[: width - 3]}..."
