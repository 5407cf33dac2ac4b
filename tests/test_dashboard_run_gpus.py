"""`orch up --dashboard` samples the GPUs on the attached run's own session (#35: "through
the agent's existing connection"): no second connection to any host, each sample a
`status` with the GPU facts on the up's links, the job's claimed GPUs shown as its own.
On the fake cluster (tests/fake_agent.py)."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fake_agent import FakeChannel, FakeCluster
from orchestrator.dashboard import feeds as feeding
from orchestrator.dashboard import page
from orchestrator.dashboard.board import Board
from orchestrator.wire import protocol
from test_controller_fake import GPUS, HOSTS, claims, gpu, inventory, orch


class GpuJob:
    """Ranks that run until the page has had `samples` GPU samples, then exit 0; each
    host's status with `gpus` answers one GPU of this job's claim."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, samples: int) -> None:
        self.fake = FakeCluster().install(monkeypatch)
        self.fake.on("preflight", claims({HOSTS[0]: [0, 2, 3], HOSTS[1]: [1, 3]}))
        self.fake.on("follow", self.follow).on("status", self.status)
        self.samples, self.enough = samples, threading.Event()
        self.gpu_asks: list[str] = []

    def follow(self, chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))

        def end() -> None:
            self.enough.wait(60)
            for r in msg["ranks"]:
                chan.push(protocol.event("exit", rank=r, code=0, time=time.time()))
            chan.push(protocol.event("done", code=0, time=time.time()))
        threading.Thread(target=end, daemon=True).start()

    def status(self, chan: FakeChannel, msg: dict) -> None:
        ranks = [{"rank": r, "state": "running", "last_line": "", "code": None} for r in msg["ranks"]]
        body: dict[str, Any] = {"supervisor": None, "host_exit": None, "time": time.time(),
                                "ranks": ranks}
        if msg.get("gpus"):
            body["gpus"] = [gpu(1, {"job_dir": msg["job_dir"], "job": "fk", "user": "ann"})]
            self.gpu_asks.append(chan.host.label)
            if len(self.gpu_asks) >= 2 * (self.samples + 1):   # the last may be dropped
                self.enough.set()
        chan.push(protocol.reply(msg["id"], body))


def test_up_dashboard_samples_gpus_on_the_runs_own_connection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = GpuJob(monkeypatch, samples=3)
    monkeypatch.setattr(feeding, "GPU_EVERY", 0.05)
    seen: list[page.Opened] = []
    real = page.open_beside_run

    def kept(*a: Any, **kw: Any) -> page.Opened:
        seen.append(real(*a, **kw))
        return seen[-1]
    monkeypatch.setattr(page, "open_beside_run", kept)
    assert orch("up", "--dashboard", "--no-pull", "-c", inventory(tmp_path, GPUS)) == 0
    assert job.enough.is_set(), "the page sampled no GPU"
    assert sorted(job.fake.tried) == [HOSTS[0], HOSTS[1]], job.fake.tried   # one connection each
    snap = seen[0].board.snapshot()
    tracks = {(g["host"], g["index"]): g for g in snap["gpus"]}
    assert len(tracks[(HOSTS[1], 1)]["samples"]) >= 3
    # the run's own state came with its session: GPU 1 of 127.0.0.2 is rank 3's claim
    assert tracks[(HOSTS[1], 1)]["holder"] == "this job, rank 3", tracks


def test_a_sample_of_an_attempt_that_ended_is_dropped() -> None:
    """The run's session closing under a sample in flight: nothing of it is shown, and
    the sampler waits for the next attempt instead of failing."""
    from test_dashboard_units import load_three
    board = Board(load_three())
    feeds = feeding.Feeds(board)
    runs = feeding.RunSessions(board, feeds, every=0.02)
    asked = threading.Event()

    class Closing:
        def status(self) -> object:
            runs.ending(self)    # type: ignore[arg-type]   # the attempt ends meanwhile
            asked.set()
            raise OSError("link closed")
    runs.started(Closing(), None)    # type: ignore[arg-type]
    feeds.start("gpus", runs.sample)
    assert asked.wait(10)
    time.sleep(0.2)
    assert feeds.threads[0].is_alive() and board.snapshot()["gpus"] == []
    assert not board.snapshot().get("notes")
    feeds.close()
    feeds.threads[0].join(5)
    assert not feeds.threads[0].is_alive()
