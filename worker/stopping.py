"""How a worker program leaves: SIGTERM (a stop) becomes `Stopped` and a quiet exit by
that signal; a background thread that breaks because a stop ended its peer is not an
error; and the last exit skips C++ static destructors (`exit_now`)."""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Stopped(BaseException):
    """SIGTERM (orch stop, a scheduler): leave quietly. BaseException, so that no
    ``except Exception`` on the way swallows it."""


class _Deferred:
    active = False    # inside stop_deferred()
    pending = False   # a SIGTERM came in there


def on_sigterm(signum: int, frame: Any) -> None:
    # From here on, a background thread that breaks because its peer is going away too
    # (the data loader's fd-sharing listener, a gloo thread) is the stop, not an error:
    # its traceback would bury the one line a stop prints.
    threading.excepthook = lambda args: None
    if _Deferred.active:
        _Deferred.pending = True
        return
    raise Stopped()


@contextmanager
def stop_deferred() -> Iterator[None]:
    """A stop that comes inside the block is taken at its end. Raised inside torch.save,
    Stopped left its zip writer half done, whose own error then replaced it: a stop during
    a checkpoint's write was a traceback and exit 1, not the quiet stop. (Only the Python
    handler waits: blocking the signal in this thread would not hold it back from the
    others.) A stop's grace period still bounds the wait: SIGKILL comes after it."""
    _Deferred.active = True
    try:
        yield
    finally:
        _Deferred.active = False
    if _Deferred.pending:
        _Deferred.pending = False
        raise Stopped()


def _peer_gone(exc_type: type[BaseException], tb: Any) -> bool:
    """The data loader's fd-sharing thread (multiprocessing.resource_sharer) broke because
    the loader process it serves is gone, as when a stop ends both: that is the stop,
    which our SIGTERM handler may not have seen yet (the main thread waits in C)."""
    if not issubclass(exc_type, (BrokenPipeError, ConnectionResetError)):
        return False
    sharer = os.path.join("multiprocessing", "resource_sharer.py")
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(sharer):
            return True
        tb = tb.tb_next
    return False


def quiet_sys_hook(exc_type: type[BaseException], exc: Any, tb: Any) -> None:
    """sys.excepthook: the resource sharer reports its own errors through it."""
    if not _peer_gone(exc_type, tb):
        sys.__excepthook__(exc_type, exc, tb)


def quiet_thread_hook(args: Any) -> None:
    """threading.excepthook, for the same error in any thread that does not catch it."""
    if not _peer_gone(args.exc_type, args.exc_traceback):
        threading.__excepthook__(args)


def stop_follows(seconds: float = 2.0) -> bool:
    """After a collective failed: was it because the job is being stopped?

    A stop sends SIGTERM to every rank at once; the first to leave breaks the collective
    of the others, whose gloo error can reach Python just before their own SIGTERM does.
    """
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except Stopped:
        return True
    return False


STOPPED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


def exit_now(code: int) -> None:
    """Leave without C++ static destructors: gloo's threads can still be joinable at
    interpreter exit, which aborts a rank that finished fine (a rare SIGABRT, seen in CI).
    A stopped run ends by SIGTERM itself, so its parent sees that signal as the cause."""
    gc.collect()   # finalisers that end child processes run before we go (train.main
    # ended its own loaders' workers already: data.end_loaders)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == STOPPED:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(code)
