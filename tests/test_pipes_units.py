"""ui/console's guard of the standard streams: EPIPE on stdout is never raised in the
thread that wrote (a link's reader would blame the host), the main thread is
interrupted once, and the CLI answers 141 without a word."""
from __future__ import annotations

import argparse
import errno
import io
import os
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

import pytest

from orchestrator import cli
from orchestrator.ui import console


@pytest.fixture
def closed_pipe() -> Iterator[BinaryIO]:
    """The write end of a pipe whose reader already left."""
    r, w = os.pipe()
    os.close(r)
    console.STDOUT_CLOSED.clear()
    console._INTERRUPTING.set()
    console.new_command()
    with open(w, "wb", buffering=0) as f:
        yield f
    console.stop_interrupting()
    console.STDOUT_CLOSED.clear()


def test_a_thread_writing_to_a_closed_stdout_interrupts_the_main_thread(closed_pipe: BinaryIO) -> None:
    out = console._Guarded(closed_pipe, is_stdout=True)
    raised: list[BaseException] = []

    def reader_thread() -> None:
        try:
            out.write(b"[r0 host] line\n")
            out.flush()
            out.write(b"more\n")   # after the first: nothing, and no second interrupt
        except BaseException as e:  # whatever it is, the test fails on it
            raised.append(e)
    with pytest.raises(KeyboardInterrupt):
        threading.Thread(target=reader_thread).start()
        for _ in range(100):
            time.sleep(0.05)
    assert raised == [] and console.STDOUT_CLOSED.is_set()
    os.write(closed_pipe.fileno(), b"x")   # the descriptor now points at /dev/null


def test_the_main_thread_writing_is_interrupted_at_once(closed_pipe: BinaryIO) -> None:
    out = console._Guarded(closed_pipe, is_stdout=True)
    with pytest.raises(KeyboardInterrupt):
        out.write(b"a table\n")
    assert console.STDOUT_CLOSED.is_set()


def test_no_second_interrupt_after_a_signal_s(closed_pipe: BinaryIO) -> None:
    """Ctrl-C reached orch and the pipe's reader together (`orch up | tee`): the signal
    interrupted the command, and the rank lines written during the stop it started find
    the pipe closed. That is no second interrupt: the stop must run to its end."""
    assert console.note_interrupt()   # the signal's handler (cli.interrupt_on_termination)
    out = console._Guarded(closed_pipe, is_stdout=True)
    th = threading.Thread(target=out.write, args=(b"[r0 host] terminated\n",))
    th.start()
    th.join()
    out.write(b"the main thread's line\n")   # nor raised here
    time.sleep(0.3)   # a pending interrupt would land here
    assert console.STDOUT_CLOSED.is_set()


def test_eio_is_a_terminal_gone_and_other_errors_are_raised(closed_pipe: BinaryIO) -> None:
    """A hung-up terminal answers EIO: nothing written is read again, as with EPIPE.
    A full disk (ENOSPC) is not a reader gone: raised as it was."""
    class Failing(io.RawIOBase):
        def __init__(self, code: int) -> None:
            self.code = code

        def write(self, data: object) -> int:
            raise OSError(self.code, os.strerror(self.code))

        def fileno(self) -> int:   # pointed at /dev/null once gone
            return closed_pipe.fileno()
    with pytest.raises(OSError, match="No space"):
        console._Guarded(Failing(errno.ENOSPC), is_stdout=True).write(b"x")  # type: ignore[arg-type]
    assert not console.STDOUT_CLOSED.is_set()
    tty = console._Guarded(Failing(errno.EIO), is_stdout=False)  # type: ignore[arg-type]
    assert tty.write(b"x") == 1 and tty.gone


def test_a_closed_stderr_only_goes_quiet(closed_pipe: BinaryIO) -> None:
    err = console._Guarded(closed_pipe, is_stdout=False)
    assert err.write(b"warning: ...\n") == len(b"warning: ...\n")
    err.flush()
    assert not console.STDOUT_CLOSED.is_set()


def test_cli_ends_quietly_with_141(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def closed(args: object) -> int:
        console.STDOUT_CLOSED.set()
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "parse", lambda argv: argparse.Namespace(func=closed, json=False))
    try:
        assert cli.cli(["logs"]) == cli.EXIT_PIPE == 141
    finally:
        console.STDOUT_CLOSED.clear()
    assert capsys.readouterr().err == ""


def test_no_interrupt_once_the_command_is_over(closed_pipe: BinaryIO) -> None:
    console.stop_interrupting()
    out = console._Guarded(closed_pipe, is_stdout=True)
    th = threading.Thread(target=out.write, args=(b"late\n",))
    th.start()
    th.join()
    time.sleep(0.2)   # a pending interrupt would land here
    assert console.STDOUT_CLOSED.is_set()
