"""Host text reaching a terminal or rich: escaped, never interpreted."""
from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from orchestrator.ui.termsafe import for_terminal, plain, visible


def test_sgr_colours_pass_other_escapes_are_shown() -> None:
    assert for_terminal(b"\x1b[31mred\x1b[0m") == b"\x1b[31mred\x1b[0m"
    osc = b"\x1b]0;pwned title\x07after"
    assert for_terminal(osc) == b"\\x1b]0;pwned title\\x07after"
    assert b"\x1b" not in for_terminal(b"\x1b[2J\x1b[H clear screen")


def test_carriage_return_cannot_overwrite_a_prefix() -> None:
    assert for_terminal(b"progress\r[r1 host] forged") == b"progress\\r[r1 host] forged"


def test_invalid_utf8_and_c1_controls_are_escaped() -> None:
    assert for_terminal(b"ok \xff\xfe end") == b"ok \\xff\\xfe end"
    assert for_terminal("a\u009bb".encode()) == b"a\\x9bb"          # C1 CSI
    assert for_terminal("x\u202eevil".encode()) == b"x\\u202eevil"  # bidi override


def test_text_and_tabs_unchanged() -> None:
    line = "epoch 3\tloss 0.25 — ünïcode ✓"
    assert visible(line) == line


def test_rich_markup_in_host_text_is_literal() -> None:
    table = Table()
    table.add_column("last line")
    table.add_row(plain("[/bold] [red]not red[/red] \x1b[31mx"))
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(table)
    out = buf.getvalue()
    assert "[/bold] [red]not red[/red] x" in out
