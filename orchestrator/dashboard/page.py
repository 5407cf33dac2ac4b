"""A dashboard put together: its board, feeds and server (`open_for_job` for `orch
dashboard`, `open_beside_run` for `orch up --dashboard`), the stop the button asks
for, and the browser opened where there is a display to open it on."""
from __future__ import annotations

import errno
import os
import sys
import threading
import webbrowser
from collections.abc import Callable

from orchestrator.api import jobs, reading
from orchestrator.config.inventory import Cluster
from orchestrator.dashboard import feeds as feeding
from orchestrator.dashboard.board import Board
from orchestrator.dashboard.server import Dashboard, LogReader, Stop
from orchestrator.errors import UsageError


class Opened:
    """A served dashboard and its feeds; `close()` ends both."""

    def __init__(self, board: Board, feeds: feeding.Feeds, server: Dashboard) -> None:
        self.board, self.feeds, self.server = board, feeds, server

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.feeds.close()
        self.server.close()


def stopper(inventory: jobs.Inventory) -> Stop:
    """The stop button's action: `orch stop` of the same inventory."""
    def stop() -> str:
        from orchestrator import api
        result = api.stop(inventory)
        n = len(result.hosts)
        return f"stopped on {n} host{'s' if n != 1 else ''}"
    return stop


MAX_DOWNLOAD_LINES = 1_000_000       # a rank's download: its newest lines, read on the host
MAX_DOWNLOAD_BYTES = 256 * 2 ** 20   # and at most this much of them (the rest: `orch logs`)


class Capped(reading.RawLog):
    """A rank's log bytes handed to `out` (the download's answer) as the host sends
    them, up to `cap` bytes; a reader gone away or the cap reached ends the reading."""

    def __init__(self, out: Callable[[bytes], None], cap: int = MAX_DOWNLOAD_BYTES) -> None:
        super().__init__()
        self.out, self.room, self.cut = out, cap, False

    def write(self, data: bytes) -> None:
        piece = data[:self.room]
        try:
            self.out(piece)
        except OSError:     # the browser closed the download
            raise BrokenPipeError from None
        self.room -= len(piece)
        if len(piece) < len(data):
            self.cut = True
            raise BrokenPipeError    # RawLog: the reading ends here


def log_reader(inventory: jobs.Inventory) -> LogReader:
    """The download's reading of rank R's whole log, as `orch logs --rank R` reads it:
    on its host, over a session of its own; what ends it early, in words."""
    def read(rank: int, out: Callable[[bytes], None]) -> str:
        sink = Capped(out)
        host, _ = reading.read_log(inventory, rank=rank, tail=MAX_DOWNLOAD_LINES, sink=sink)
        if sink.cut:
            return (f"cut at {MAX_DOWNLOAD_BYTES // 2 ** 20} MiB: the rest with "
                    f"`orch logs --rank {rank}`")
        return f"{host}: {sink.why}" if sink.why else ""
    return read


def serve(board: Board, stop: Stop | None, port: int,
          read_log: LogReader | None = None) -> Dashboard:
    try:
        return Dashboard(board, stop, port, read_log).start()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on 127.0.0.1 is in use",
                             hint="pass another --port, or --port 0 for any free one") from None
        raise UsageError(f"cannot listen on 127.0.0.1:{port}: {e.strerror}",
                         hint="pass another --port, or --port 0 for any free one") from None


def open_for_job(inventory: jobs.Inventory, port: int = 0,
                 gpu_every: float = feeding.GPU_EVERY) -> Opened:
    """`orch dashboard`: the inventory's job followed (a mistake raises before anything
    is served), then served."""
    board = Board(jobs.run_cluster(inventory))
    feeds = feeding.Feeds(board)
    try:
        feeding.start_all(inventory, board, feeds, gpu_every)
        return Opened(board, feeds, serve(board, stopper(inventory), port, log_reader(inventory)))
    except BaseException:
        feeds.close()
        raise


def open_beside_run(cluster: Cluster, inventory: jobs.Inventory, port: int = 0) -> Opened:
    """`orch up --dashboard`: a board the attached run feeds with its own events (the
    caller hands `opened.board` to the run as one more reader), the curves, and GPU
    samples asked on the run's own session (the caller hands it `opened.feeds.runs`)."""
    board = Board(cluster, mode="attached")
    feeds = feeding.Feeds(board)
    try:
        feeds.start("curves", lambda: feeding.read_curves(cluster, board, feeds))
        if any(h.gpus for h in cluster.hosts):
            feeds.start("gpus", feeds.runs.sample)   # on the run's own sessions
        return Opened(board, feeds, serve(board, stopper(inventory), port, log_reader(inventory)))
    except BaseException:
        feeds.close()
        raise


def has_display() -> bool:
    """A graphical browser can open: macOS, Windows, or an X11/Wayland session (never a
    text browser taking over the terminal the run prints to)."""
    return sys.platform in ("darwin", "win32") or bool(
        os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def open_browser(url: str, say: Callable[[str], None]) -> None:
    if not has_display():
        say("no display here: open the URL in a browser (over SSH: `ssh -L PORT:127.0.0.1:PORT`)")
        return
    threading.Thread(target=webbrowser.open, args=(url,), daemon=True, name="browser").start()
