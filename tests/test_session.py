"""Controller logic over in-process fake agents (tests/fake_agent.py): fail-fast stops
every host and names the earliest failing rank; a stop reaches every host once."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from fake_agent import FakeChannel, FakeTransport, later
from orchestrator.commands.uprender import attach
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_JOB_FAILED
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import HostState, JobState
from orchestrator.wire import protocol

SUP = Supervisor(1, 1, None, 2, "run", 0.0)   # a launched host's supervisor

INVENTORY = """name: fake
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: localhost, connection: local, remote_dir: /r1, procs: 2}
job: {entrypoint: job.py}
"""


def job(tmp_path: Path, handlers: dict):
    cluster = parse(INVENTORY, tmp_path / "cluster.yaml")
    transports: dict[int, FakeTransport] = {}

    def connector(host):
        transports[host.index] = FakeTransport(host, handlers)
        transports[host.index].channel.skew = 10.0 * host.index   # its clock, as in its exits
        return transports[host.index]
    state = JobState("fake", "run", "cluster.yaml", 0.0, 4, "127.0.0.1", 29500,
                     [HostState(h.index, h.label, f"/r{h.index}/fake", list(h.ranks),
                                10.0 * h.index, SUP) for h in cluster.hosts])
    return cluster, Session(cluster, state, connector=connector).open(), state, transports


def failing_job_handlers(stopped: threading.Event) -> dict:
    """Rank 3 (host 1) exits 7; every other rank runs until a stop ends it (SIGTERM).
    Host i's clock runs 10*i s ahead, as the state's offsets say."""
    def follow(chan: FakeChannel, msg: dict) -> None:
        ahead = 10.0 * chan.host.index
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        if 3 in msg["ranks"]:
            chan.push(protocol.output(3, b"boom\n"))
            later(0.2, lambda: chan.push(protocol.event("exit", rank=3, code=7,
                                                        time=time.time() + ahead)))

        def end() -> None:
            stopped.wait(10)
            for r in msg["ranks"]:
                if r != 3:
                    chan.push(protocol.event("exit", rank=r, code=-15, time=time.time() + ahead))
            chan.push(protocol.event("done", code=1))
        threading.Thread(target=end, daemon=True).start()

    def stop(chan: FakeChannel, msg: dict) -> None:
        stopped.set()
        chan.push(protocol.reply(msg["id"], {"found": 2, "killed": 0, "left": [], "seconds": 0.1}))

    def status(chan: FakeChannel, msg: dict) -> None:
        # the truth of each rank: only rank 3 failed (7) and left an error file; the
        # others were ended by the stop, each with an error file of its own
        ranks = [{"rank": r, "state": "exited", "last_line": "", "code": 7 if r == 3 else -15,
                  "error_file": f"ValueError: bad batch {r}" if r == 3 else f"SIGTERM in rank {r}"}
                 for r in msg["ranks"]]
        dumps = {"nccl_dumps": ["nccl-trace-rank-3"]} if 3 in msg["ranks"] else {}
        chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                             "time": 1.0, "ranks": ranks, **dumps}))
    return {"follow": follow, "stop": stop, "status": status}


def test_fail_fast_stops_every_host_and_names_the_root_cause(tmp_path: Path, capsys) -> None:
    stopped = threading.Event()
    _cluster, session, state, transports = job(tmp_path, failing_job_handlers(stopped))
    t0 = time.monotonic()
    try:
        code = attach(session, state)
    finally:
        session.close()
    assert code == EXIT_JOB_FAILED and time.monotonic() - t0 < 10
    for t in transports.values():
        kinds = [m["t"] for m in t.channel.requests]
        assert kinds.count("follow") == 1 and kinds.count("stop") == 1, kinds
        stop = next(m for m in t.channel.requests if m["t"] == "stop")
        assert stop["grace"] == 3.0
    err = " ".join(capsys.readouterr().err.split())
    # the stop's SIGTERM exits (after it began, by the corrected clocks) are not causes
    assert "root cause rank 3 on host localhost" in err and "exit code 7" in err, err
    # the error file is rank 3's, asked of rank 3's host alone
    assert "ValueError: bad batch 3" in err and "boom" in err and "SIGTERM in rank" not in err, err
    # NCCL's flight recorder dump on that host (its watchdog wrote it before the rank died)
    assert re.search(r"NCCL flight recorder dump: localhost#1: /r1/fake/run/host-\S+/nccl-trace-rank-3 ", err), err
    asked = [m["ranks"] for t in transports.values() for m in t.channel.requests if m["t"] == "status"]
    assert asked == [[3]], asked
    assert [m["t"] for m in transports[0].channel.requests].count("status") == 0


def test_stop_reaches_every_host_once(tmp_path: Path) -> None:
    stopped = threading.Event()
    _cluster, session, _state, transports = job(tmp_path, failing_job_handlers(stopped))
    try:
        result = session.stop(1.5)
    finally:
        session.close()
    assert sorted(result.ok) == [0, 1] and not result.failed
    assert all(r.describe() == "stopped 2 processes; verified none left" for r in result.ok.values())
    for i, t in transports.items():
        stops = [m for m in t.channel.requests if m["t"] == "stop"]
        assert [(m["job_dir"], m["grace"]) for m in stops] == [(f"/r{i}/fake", 1.5)]
