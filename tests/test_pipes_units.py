"""ui/console's guard of the standard streams: EPIPE on stdout is never raised in the
thread that wrote (a link's reader would blame the host), the main thread is
interrupted once, and the CLI answers 141 without a word."""
from __future__ import annotations

import argparse
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
