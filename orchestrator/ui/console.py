"""Where things go: messages and progress on stderr (`console`); what a command answers
(its table, the job's output) on stdout (`out`), so `orch status > f` and
`orch status | grep running` work as with any CLI."""
from __future__ import annotations

import _thread
import ctypes
import errno
import io
import logging
import os
import signal
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
            except OSError as e:
                self._failed(e)
        return len(data)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.raw.flush()
            except OSError as e:
                self._failed(e)

    def _failed(self, e: OSError) -> None:
        """EPIPE: the reader left; EIO: the terminal hung up (its window closed). Either
        way nothing written here is read again. Anything else is raised as it was."""
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise e
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
# Set by the first interruption, a signal's (note_interrupt) or a closed stdout's: what
# the command does about it (`orch up`'s stop on every host) must run to its end. The
# reader of a pipe is often interrupted with orch (Ctrl-C reaches `orch up | tee`'s whole
# process group), and a rank's last line written during the stop then found the pipe
# closed: a second interrupt ended the stop half done and left the job running.
_INTERRUPTED = threading.Event()
_ONCE = threading.Lock()


def note_interrupt() -> bool:
    """The command is being interrupted (a signal's handler calls this); True the first
    time. A closed stdout interrupts nothing after it."""
    with _ONCE:
        first = not _INTERRUPTED.is_set()
        _INTERRUPTED.set()
    return first


def new_command() -> None:
    """A command starts: not interrupted yet (a test runs many in one process)."""
    _INTERRUPTED.clear()


def interrupt_main() -> None:
    """KeyboardInterrupt in the main thread, once per command, and never after a
    signal's: raised here when this is it; otherwise delivered at its next bytecode (its
    waits are short: 0.1-0.2 s), as a simulated SIGINT where Python handles SIGINT, and
    else as an exception set in its state (a background job's SIGINT is ignored)."""
    if not note_interrupt():
        return
    main = threading.main_thread()
    if threading.current_thread() is main:
        raise KeyboardInterrupt
    if not _INTERRUPTING.is_set():
        return
    if callable(signal.getsignal(signal.SIGINT)):
        # a simulated SIGINT, run by the main thread's own handler. An exception set
        # with PyThreadState_SetAsyncExc can land in a thread the main thread is just
        # starting (its state still carries the main thread's id) and be lost there.
        _thread.interrupt_main(signal.SIGINT)
    elif main.ident is not None:   # SIGINT ignored (`orch up &` in a script)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main.ident),
                                                   ctypes.py_object(KeyboardInterrupt))


def stop_interrupting() -> None:
    """The command is over (called in the main thread): no interrupt from now on, and
    one still pending is dropped, so that the process's end runs whole (a simulated
    SIGINT still pending is the caller's: `orch` ignores SIGINT from here on)."""
    _INTERRUPTING.clear()
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threading.get_ident()), None)


def guard_std_streams() -> None:
    """sys.stdout and sys.stderr through _Guarded (the `orch` command only: a test's
    captured streams are left alone)."""
    _INTERRUPTING.set()
    new_command()
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
