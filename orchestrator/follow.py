"""follow(): the one log tail every printer uses (orch up, orch logs, orch logs -f).

Each host runs one agent `follow` over the connection that is already open; it reads
the rank log files in place from a byte offset, so a line is sent once, in order, and
nothing is lost if the controller goes away (the files stay; a new follow re-reads).
The agent's protocol, one item per line:
    L <rank> <text>     a log line of a rank
    E <rank> <code> <t> that rank exited (t: host clock)
    X <json>            the host's torchrun has ended ({"code": ..}); last item
    T                   heartbeat, once a second: silence means the host is lost
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from orchestrator.remote import open_agent
from orchestrator.transport import Channel, Transport

HOST_LOST_S = 15.0
TAIL_KEEP = 20


class Sink(Protocol):
    def lines(self, host: int, rank: int, texts: list[bytes]) -> None: ...
    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None: ...
    def host_done(self, host: int, info: dict) -> None: ...
    def host_lost(self, host: int, why: str) -> None: ...


@dataclass
class HostStream:
    transport: Transport
    job_dir: str
    ranks: list[int]
    last_seen: float = field(default_factory=time.monotonic)
    done: bool = False
    chan: Channel | None = None   # an agent already streaming (launch ... follow)
    pending: bytes = b""          # what it sent after its first reply line


def parse_chunk(stream: HostStream, index: int, data: bytes, sink: Sink) -> None:
    """Group consecutive lines of a rank so the sink is called once per run, not per line."""
    run_rank, run = -1, []
    for line in data.split(b"\n"):
        tag = line[:1]
        if tag == b"L":
            _, rank, text = (line.split(b" ", 2) + [b""])[:3]
            rank = int(rank)
            if rank != run_rank and run:
                sink.lines(index, run_rank, run)
                run = []
            run_rank = rank
            run.append(text)
            continue
        if run:
            sink.lines(index, run_rank, run)
            run_rank, run = -1, []
        if tag == b"E":
            _, rank, code, when = line.split(b" ")
            sink.rank_exit(index, int(rank), int(code) if code != b"None" else -1, float(when))
        elif tag == b"X":
            stream.done = True
            sink.host_done(index, json.loads(line[2:]))
    if run:
        sink.lines(index, run_rank, run)


def read_host(index: int, stream: HostStream, sink: Sink, tail: int, mode: str) -> None:
    t = stream.transport
    try:
        chan, pending = stream.chan, b""
        if chan is None:
            chan = open_agent(t, "follow", stream.job_dir, ",".join(map(str, stream.ranks)),
                              str(tail), mode)
            chan.close_stdin()
        first = [stream.pending] if stream.pending else []
        for data in itertools.chain(first, iter(chan.read, b"")):
            stream.last_seen = time.monotonic()
            data = pending + data
            cut = data.rfind(b"\n")
            if cut < 0:
                pending = data
                continue
            pending = data[cut + 1:]
            parse_chunk(stream, index, data[:cut], sink)
        chan.close()
    except Exception as exc:  # a broken connection is a lost host, reported by the sink
        if not stream.done:
            sink.host_lost(index, f"connection lost: {exc}")
        return
    if not stream.done:
        sink.host_lost(index, "the log stream ended before the job did")


def watchdog(streams: dict[int, HostStream], sink: Sink, stop: threading.Event) -> None:
    """A host that sends not even a heartbeat for HOST_LOST_S is lost (keepalive)."""
    while not stop.wait(1.0):
        for index, s in streams.items():
            if not s.done and time.monotonic() - s.last_seen > HOST_LOST_S:
                s.done = True
                sink.host_lost(index, f"no answer for {HOST_LOST_S:.0f} s")


def follow(streams: dict[int, HostStream], sink: Sink, tail: int = -1,
           mode: str = "events") -> Callable[[], bool]:
    """Start following every host; returns `finished()`, true once every host is done.
    mode "events" follows until the job ends; "tagged" prints what is there and stops."""
    stop = threading.Event()
    threads = [threading.Thread(target=read_host, args=(i, s, sink, tail, mode), daemon=True)
               for i, s in streams.items()]
    threading.Thread(target=watchdog, args=(streams, sink, stop), daemon=True).start()
    for th in threads:
        th.start()

    def finished() -> bool:
        done = all(s.done for s in streams.values())
        if done:
            stop.set()
        return done
    return finished


# ---------------------------------------------------------------- printing

COLORS = (31, 32, 33, 34, 35, 36, 91, 92, 93, 94, 95, 96)


def use_color() -> bool:
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and not os.environ.get("ORCH_NO_COLOR")


class PrefixPrinter:
    """Prints `[r3 host] line`, a colour per rank; keeps each rank's last lines."""

    def __init__(self, labels: dict[int, str], out=None) -> None:
        self.out = out or sys.stdout.buffer
        self.labels = labels
        self.color = use_color()
        self.lock = threading.Lock()
        self.tails: dict[int, deque] = {}

    def prefix(self, host: int, rank: int) -> bytes:
        tag = f"[r{rank} {self.labels[host]}]"
        if self.color:
            tag = f"\x1b[{COLORS[rank % len(COLORS)]}m{tag}\x1b[0m"
        return tag.encode() + b" "

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        pre = self.prefix(host, rank)
        block = b"".join(pre + t + b"\n" for t in texts)
        with self.lock:
            self.tails.setdefault(rank, deque(maxlen=TAIL_KEEP)).extend(texts[-TAIL_KEEP:])
            self.out.write(block)
            self.out.flush()

    def tail(self, rank: int) -> list[str]:
        return [t.decode("utf-8", "replace") for t in self.tails.get(rank, ())]
