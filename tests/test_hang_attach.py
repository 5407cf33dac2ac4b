"""The hang path of `orch up`'s monitor over in-process fake agents (tests/fake_agent.py)
behind the real Link: the follow asks for heartbeats, `progress` events keep a quiet rank
alive, a hang asks every host for its stacks and names the culprit, then stops the job;
a host that reports progress of a rank it does not run is refused."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from fake_agent import FakeChannel, FakeTransport
from orchestrator.commands.uprender import attach
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_JOB_FAILED, EXIT_OK
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import HostState, JobState
from orchestrator.wire import protocol

SUP = Supervisor(1, 1, None, 2, "run", 0.0)   # a launched host's supervisor

INVENTORY = """name: fake
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: localhost, connection: local, remote_dir: /r1, procs: 1}
job: {entrypoint: job.py, hang_timeout: 1}
"""
IN_ALL_REDUCE = """Current thread 0x1 (most recent call first):
  File "/v/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/j/code/job.py", line 14 in train_step
  File "/j/code/job.py", line 30 in <module>
"""
ASLEEP = """Current thread 0x1 (most recent call first):
  File "/j/code/job.py", line 11 in train_step
  File "/j/code/job.py", line 30 in <module>
"""


def run_job(tmp_path: Path, handlers: dict) -> tuple[int, dict[int, list[dict]]]:
    cluster = parse(INVENTORY, tmp_path / "cluster.yaml")
    transports: dict[int, FakeTransport] = {}

    def connector(host: Any) -> FakeTransport:
        transports[host.index] = FakeTransport(host, handlers)
        return transports[host.index]
    state = JobState("fake", "run", str(tmp_path / "cluster.yaml"), 0.0, 3, "127.0.0.1", 29500,
                     [HostState(h.index, h.label, f"/r{h.index}/fake", list(h.ranks), 0.0, SUP)
                      for h in cluster.hosts])
    session = Session(cluster, state, connector=connector).open()
    try:
        code = attach(session, state)
    finally:
        session.close()
    return code, {i: list(t.channel.requests) for i, t in transports.items()}


def handlers(stopped: threading.Event, *, quiet_for: float = 0.0, touch: bool = True,
             bogus_rank: bool = False) -> dict:
    """Every rank prints one line; rank 2 (host 1) then stays quiet. With `quiet_for`,
    the job ends well after that long, rank 2 touching its heartbeat (if `touch`) and
    rank 0 printing on; otherwise every rank is quiet until a stop."""
    def follow(chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))

        def run() -> None:
            end = time.monotonic() + quiet_for
            while time.monotonic() < end and not stopped.is_set():
                chan.push(protocol.event("beat", time=time.time()))
                if 0 in msg["ranks"]:
                    chan.push(protocol.output(0, b"rank 0 working\n"))
                if 2 in msg["ranks"] and touch:
                    chan.push(protocol.event("progress", ranks=[7] if bogus_rank else [2]))
                time.sleep(0.2)
            if quiet_for and not stopped.is_set():
                for r in msg["ranks"]:
                    chan.push(protocol.event("exit", rank=r, code=0, time=time.time()))
                chan.push(protocol.event("done", code=0))
                return
            while not stopped.wait(0.3):
                chan.push(protocol.event("beat", time=time.time()))
            for r in msg["ranks"]:
                chan.push(protocol.event("exit", rank=r, code=-15, time=time.time(),
                                         after_stop=True))
            chan.push(protocol.event("done", code=1))
        threading.Thread(target=run, daemon=True).start()

    def stacks(chan: FakeChannel, msg: dict) -> None:
        ranks = [{"rank": r, "state": "answered", "pid": 100 + r,
                  "stack": ASLEEP if r == 2 else IN_ALL_REDUCE} for r in msg["ranks"]]
        dumps = ["nccl-trace-rank-2"] if 2 in msg["ranks"] else []
        chan.push(protocol.reply(msg["id"], {"ranks": ranks, "nccl_dumps": dumps,
                                             "time": time.time()}))

    def stop(chan: FakeChannel, msg: dict) -> None:
        stopped.set()
        chan.push(protocol.reply(msg["id"], {"found": 1, "killed": 0, "left": [],
                                             "seconds": 0.1}))
    return {"follow": follow, "stacks": stacks, "stop": stop}


def kinds(requests: dict[int, list[dict]]) -> dict[int, list[str]]:
    return {i: [m["t"] for m in reqs] for i, reqs in requests.items()}


def test_a_hang_takes_every_stack_names_the_culprit_and_stops(tmp_path: Path, capsys: Any) -> None:
    stopped = threading.Event()
    started = time.monotonic()
    code, requests = run_job(tmp_path, handlers(stopped))
    err = " ".join(capsys.readouterr().err.split())
    assert code == EXIT_JOB_FAILED
    assert time.monotonic() - started < 10
    assert "hang: no rank made progress (output or heartbeat) for 1 s (hang_timeout 1 s)" in err
    assert ("root cause rank 2 on host localhost#1 (local rank 0): in train_step (job.py:11) "
            "while 2 other ranks are in all_reduce (distributed_c10d.py:2050)") in err, err
    assert "stopped the job on every host" in err
    assert re.search(r"NCCL flight recorder dump: localhost#1: /r1/fake/run/host-\S+/"
                     r"nccl-trace-rank-2", err), err
    for i, reqs in requests.items():
        follow = next(m for m in reqs if m["t"] == "follow")
        assert follow["heartbeats"] is True
        asked = next(m for m in reqs if m["t"] == "stacks")
        assert asked["ranks"] == ([0, 1] if i == 0 else [2]) and asked["reason"].startswith("hang:")
        assert kinds(requests)[i].count("stop") == 1


def test_heartbeats_keep_a_quiet_rank_alive(tmp_path: Path, capsys: Any) -> None:
    code, requests = run_job(tmp_path, handlers(threading.Event(), quiet_for=3.0))
    assert code == EXIT_OK, capsys.readouterr().err
    assert all("stacks" not in k and "stop" not in k for k in kinds(requests).values())


def test_progress_of_a_rank_the_host_does_not_run_is_refused(tmp_path: Path, capsys: Any) -> None:
    """The refusal loses the host at once, even when the event is read before the follow
    request's send has returned: the job fails for it, not later as a hang, and not at
    the job's own end (30 s on: rank 0 prints on, so no silence would end it earlier)."""
    started = time.monotonic()
    code, _ = run_job(tmp_path, handlers(threading.Event(), quiet_for=30.0, bogus_rank=True))
    err = " ".join(capsys.readouterr().err.split())
    assert code == EXIT_JOB_FAILED
    assert "progress of a rank which is not followed here" in err, err
    assert "hang:" not in err and time.monotonic() - started < 20, err
