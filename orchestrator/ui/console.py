"""Where things go: messages and progress on stderr (`console`); what a command answers
(its table, the job's output) on stdout (`out`), so `orch status > f` and
`orch status | grep running` work as with any CLI."""
from __future__ import annotations

import ctypes
import io
import logging
import os
import sys
import threading
from typing import Any, BinaryIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from orchestrator.ui.termsafe import plain_lines

console = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)   # tables: the answer, on stdout


# The bars are drawn on a terminal only: redirected (`orch up 2>log`), a transient bar
# would leave nothing useful but its end, an empty first line.
def hosts_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("hosts"), console=console, transient=True,
                    disable=not console.is_terminal)


def bytes_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


class _Warnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        console.print("[yellow]warning:[/]", plain_lines(record.getMessage()))


def warnings_to_console() -> None:
    """The library's warnings (the `orchestrator` logger: a damaged state file, a host key
    recorded under accept-new) printed as the CLI's own `warning:` lines on stderr."""
    log = logging.getLogger("orchestrator")
    if not any(isinstance(h, _Warnings) for h in log.handlers):
        log.addHandler(_Warnings(logging.WARNING))


# ---------------------------------------------------------------- a closed stdout

# Set once stdout's reader went away (`orch logs | head -2`): the user's pipe, not a host.
STDOUT_CLOSED = threading.Event()


class _Guarded(io.BufferedIOBase):
    """A standard stream's bytes, on a pipe whose reader may leave. EPIPE on stdout is
    never raised in the thread that wrote (a link's reader thread would take it for a
    lost host): the stream is pointed at /dev/null, STDOUT_CLOSED set, and the main
    thread interrupted, once, so the command ends as on Ctrl-C and the CLI exits 141.
    A closed stderr only silences the messages: the answer on stdout still matters."""

    def __init__(self, raw: BinaryIO, is_stdout: bool) -> None:
        super().__init__()
        self.raw, self.is_stdout = raw, is_stdout
        self.gone = False
        self.lock = threading.Lock()

    def write(self, data: Any) -> int:
        if not self.gone:
            try:
                self.raw.write(data)
            except BrokenPipeError:
                self._gone()
        return len(data)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.raw.flush()
            except BrokenPipeError:
                self._gone()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.raw.isatty()

    def fileno(self) -> int:
        return self.raw.fileno()

    def _gone(self) -> None:
        with self.lock:
            first, self.gone = not self.gone, True
            if first:   # what is still buffered, and any later writer, go nowhere
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.raw.fileno())
                os.close(devnull)
        if first and self.is_stdout:
            STDOUT_CLOSED.set()
            interrupt_main()


_INTERRUPTING = threading.Event()   # set while the command runs (guard_std_streams)


def interrupt_main() -> None:
    """KeyboardInterrupt in the main thread: raised here when this is it; otherwise
    delivered at its next bytecode (its waits are short: 0.1-0.2 s). Not through
    SIGINT, which a background job may have ignored."""
    main = threading.main_thread()
    if threading.current_thread() is main:
        raise KeyboardInterrupt
    if main.ident is not None and _INTERRUPTING.is_set():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident),
                                                   ctypes.py_object(KeyboardInterrupt))


def stop_interrupting() -> None:
    """The command is over (called in the main thread): no interrupt from now on, and
    one still pending is dropped, so that the process's end runs whole."""
    _INTERRUPTING.clear()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)


def guard_std_streams() -> None:
    """sys.stdout and sys.stderr through _Guarded (the `orch` command only: a test's
    captured streams are left alone)."""
    _INTERRUPTING.set()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            stream.fileno()
            raw = stream.buffer
        except (AttributeError, OSError, ValueError):
            continue
        stream.flush()
        setattr(sys, name, io.TextIOWrapper(
            _Guarded(raw, name == "stdout"), encoding=stream.encoding, errors=stream.errors,
            line_buffering=stream.line_buffering, write_through=True))
