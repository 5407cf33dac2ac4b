"""Host text made safe for the user's terminal and for rich.

Nothing a host sends (rank output, last lines, error files, host names in replies) is
ever interpreted: on a terminal, every control character and escape sequence except SGR
colours (``ESC [ ... m``) is shown escaped (``\\x1b]0;title\\x07`` stays visible text,
``\\r`` cannot overwrite a prefix), and no host text is ever parsed as rich markup.
Piped output is not touched here: ``orch logs --rank R | ...`` stays byte-exact.
"""
from __future__ import annotations

import re

from rich.markup import escape
from rich.text import Text

# SGR: ESC [ then parameters (digits, ; and :) then m. Colours and bold are harmless.
_SGR = r"\x1b\[[0-9;:]{0,64}m"
# C0 controls but tab, DEL, C1 controls, and the bidi/zero-width format characters that
# can make a line read differently from what it is ("Trojan Source").
_UNSAFE = r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]"
_TOKEN = re.compile(f"({_SGR})|({_UNSAFE})")
_CONTROL = re.compile(_UNSAFE)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return {"\r": "\\r", "\n": "\\n"}.get(ch, f"\\x{code:02x}")
    return f"\\u{code:04x}"


def visible(text: str, keep_sgr: bool = True) -> str:
    """`text` with every unsafe character written as a visible escape."""
    def one(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return m.group(1) if keep_sgr else ""
        return _escape(m.group(2))
    return _TOKEN.sub(one, text)


def escaped(text: str) -> str:
    """`text` with every control character, SGR colours' ESC too, written as an escape:
    for values shown as they are (an argument in `up --dry-run`), never as effects."""
    return _CONTROL.sub(lambda m: _escape(m.group()), text)


def for_terminal(data: bytes) -> bytes:
    """A chunk of rank output (no newline inside) as it may reach a terminal.
    Bytes that are not UTF-8 are shown as \\xNN instead of reaching the terminal raw."""
    return visible(data.decode("utf-8", "backslashreplace")).encode("utf-8")


def plain(text: str) -> Text:
    """Host text for a rich table or message: escaped, never parsed as markup, no colour."""
    return Text(visible(text, keep_sgr=False))


def plain_lines(text: str) -> Text:
    """A message of several lines (an error and its `fix:` line) as `plain` makes each:
    the line breaks stay breaks, not a literal `\\n` in the middle of a warning."""
    return Text("\n".join(visible(line, keep_sgr=False) for line in text.split("\n")))


def markup_safe(text: str) -> str:
    """Host text to put inside a rich markup string: escaped twice over, for the
    terminal (no control sequence) and for rich (no `[tag]` read as markup)."""
    return escape("\n".join(visible(line, keep_sgr=False) for line in text.split("\n")))
