"""A one-line live status on stderr ("ranks started 3/8: h1 2/2, h2 1/2 ..."), only when
stderr is a terminal. Rank output goes to stdout as raw bytes, so rich's Live cannot step
aside for it; this line is erased before each block of output and drawn again after it,
under one lock, so the two never mix on a shared terminal. Piped output never sees it."""
from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from orchestrator.ui.wording import plural

ERASE = "\r\x1b[2K"
MAX_HOSTS_SHOWN = 8


class LiveLine:
    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.lock = threading.RLock()
        self.text = ""

    def _write(self, data: str) -> None:
        try:
            self.stream.write(data)
            self.stream.flush()
        except (OSError, ValueError):   # a closed terminal: the line is only a courtesy
            self.enabled = False

    def update(self, text: str) -> None:
        with self.lock:
            if not self.enabled:
                return
            width = shutil.get_terminal_size((80, 24)).columns
            self.text = text[:max(10, width - 1)]
            self._write(ERASE + self.text)

    @contextmanager
    def above(self) -> Iterator[None]:
        """Print something (to stdout or stderr) above the line."""
        with self.lock:
            shown = self.enabled and bool(self.text)
            if shown:
                self._write(ERASE)
            try:
                yield
            finally:
                if shown and self.enabled:
                    self._write(ERASE + self.text)

    def close(self) -> None:
        with self.lock:
            if self.enabled and self.text:
                self._write(ERASE)
            self.enabled, self.text = False, ""


def started_text(per_host: list[tuple[str, int, int]], printed: int) -> str:
    """`ranks started 3/8: h1 2/2, h2 1/2, ... (+5 hosts); 1/8 printed`: the hosts still
    waiting come first once there are more than fit."""
    done = sum(s for _, s, _ in per_host)
    total = sum(n for _, _, n in per_host)
    shown = per_host
    if len(per_host) > MAX_HOSTS_SHOWN:
        shown = sorted(per_host, key=lambda h: h[1] >= h[2])[:MAX_HOSTS_SHOWN]
    parts = [f"{label} {s}/{n}" for label, s, n in shown]
    more = len(per_host) - len(shown)
    tail = f", ... (+{plural(more, 'host')})" if more else ""
    return f"ranks started {done}/{total}: {', '.join(parts)}{tail}; first output {printed}/{total}"
