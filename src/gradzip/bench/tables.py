"""Tables and a console for the commands' output: ``rich`` when installed, plain text otherwise.

rich is an optional extra (``bench``, ``demo``). The table builders call :func:`table` and
:func:`console` instead of importing rich, so every command prints its results without it: the
same columns, aligned with spaces, and style markup such as ``[red]NO[/red]`` dropped.
"""
from __future__ import annotations

import re
import sys
from typing import Any, List, Optional

EXTRA_HINT = "pip install gradzip[bench]"
_MARKUP = re.compile(r"\[/?(?:red|green|yellow|bold|dim|italic)\]")


def has_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def plain(text: Any) -> str:
    """``text`` without rich's style markup."""
    return _MARKUP.sub("", str(text))


class PlainTable:
    """The part of ``rich.table.Table`` the builders use, rendered as aligned plain text."""

    def __init__(self, title: str = "", caption: str = "", **_: Any) -> None:
        self.title = title
        self.caption = caption
        self._columns: List[tuple] = []  # (header, justify)
        self._rows: List[Optional[List[str]]] = []  # None: a section break

    def add_column(self, header: str, justify: str = "left", **_: Any) -> None:
        self._columns.append((header, justify))

    def add_row(self, *cells: Any, end_section: bool = False, **_: Any) -> None:
        self._rows.append([plain(c) for c in cells])
        if end_section:
            self._rows.append(None)

    def __str__(self) -> str:
        rows = [r + [""] * (len(self._columns) - len(r)) for r in self._rows if r is not None]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(self._columns)]

        def line(cells: List[str]) -> str:
            parts = [c.rjust(w) if j == "right" else c.ljust(w) for c, w, (_, j) in zip(cells, widths, self._columns)]
            return " " + " ".join(parts).rstrip()

        out = [self.title] if self.title else []
        out += [line([h for h, _ in self._columns]), " " + "-" * (sum(widths) + len(widths) - 1)]
        out += ["" if r is None else line(r + [""] * (len(self._columns) - len(r))) for r in self._rows]
        if self.caption:
            out.append(self.caption)
        return "\n".join(out)


def table(title: str = "", caption: str = ""):
    """A ``rich`` table in the commands' style, or a :class:`PlainTable` without rich."""
    try:
        from rich import box
        from rich.table import Table
    except ImportError:
        return PlainTable(title=title, caption=caption)
    return Table(title=title, caption=caption, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))


class PlainConsole:
    """``print`` for tables and markup, when rich is missing; the first table says how to get rich's."""

    noted = False

    def print(self, obj: Any = "", **_: Any) -> None:
        print(plain(obj), flush=True)
        if isinstance(obj, PlainTable) and not PlainConsole.noted:
            PlainConsole.noted = True
            print(f"(plain-text table: rich is not installed; {EXTRA_HINT} for formatted ones)", flush=True)


def console():
    """rich's console (pipes and logs get the whole table, 160 columns), or a plain one."""
    try:
        from rich.console import Console
    except ImportError:
        return PlainConsole()
    return Console(width=None if sys.stdout.isatty() else 160)
