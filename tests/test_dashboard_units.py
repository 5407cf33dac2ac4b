"""The dashboard's data and server, in process: a run's events into the board (ranks,
logs, events, the root cause), GPU samples and curves, every cap; `orch dashboard` of a
job on the fake cluster (tests/fake_agent.py) served on 127.0.0.1 behind its token, a
rank's `<script>` kept as text in the JSON and in the saved page, the stop button's
request reaching every host."""
from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from fake_agent import FakeChannel, FakeCluster
from orchestrator import api
from orchestrator.api.outcomes import GpuStatus
from orchestrator.config.inventory import load
from orchestrator.dashboard import board as boards
from orchestrator.dashboard import page, server
from orchestrator.dashboard.board import Board
from orchestrator.session.network import PlanDoc
from orchestrator.watch import curves
from orchestrator.wire import protocol
from test_controller_fake import inventory

SCRIPT = b"<script>alert(1)</script>"


def wait_for(what: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


class Fetch:
    """Requests to a served dashboard, as a browser on this machine makes them."""

    def __init__(self, opened: page.Opened) -> None:
        self.port, self.token = opened.server.port, opened.server.token

    def __call__(self, path: str, method: str = "GET", host: str | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, headers={"Host": host or f"127.0.0.1:{self.port}",
                                                **(headers or {})})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def json(self, path: str) -> Any:
        status, _, body = self(path, headers={"X-Orch-Token": self.token})
        assert status == 200, body
        return json.loads(body)


def a_run_board(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Board:
    FakeCluster(lambda label, rank, env: 3 if rank == 3 else 0).install(monkeypatch)
    path = inventory(tmp_path)
    board = Board(load(Path(path)))
    with pytest.raises(api.JobError):
        api.run(path, on_event=board)
    return board


def test_a_runs_events_make_the_ranks_logs_and_timeline(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    snap = a_run_board(tmp_path, monkeypatch).snapshot()
    ranks = {r["rank"]: r for r in snap["ranks"]}
    assert sorted(ranks) == list(range(6))
    assert ranks[3]["failed"] and ranks[3]["state"] == "failed (exit code 3)"
    assert [ranks[r]["host"] for r in range(6)] == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
    assert [ranks[r]["local_rank"] for r in range(6)] == [0, 1] * 3
    assert ranks[0]["last_line"] == "rank 0 up"
    cause = snap["root_cause"]
    assert cause is not None and cause["summary"] == "rank 3 on 127.0.0.2 failed (exit code 3)"
    assert snap["ended"] and snap["outcome"] == "failed"
    kinds = [e["kind"] for e in snap["events"]]
    assert kinds[:4] == ["Synced"] * 3 + ["Started"] and kinds[-1] == "Finished"
    assert "RankLine" not in kinds and "RootCause" in kinds
    json.dumps(snap)   # JSON-ready as it is


def test_the_logs_are_numbered_and_read_from_a_cursor() -> None:
    board = Board(load_three())
    board.many([api.RankLine(1.0, 0, "h", "out", b"a"), api.RankLine(1.0, 1, "h", "out", b"b"),
                api.RankLine(2.0, 0, "h", "out", b"c")])
    first = board.log(0)
    assert [t for _, t in first["lines"]] == ["a", "c"]
    assert board.log(0, after=first["lines"][0][0])["lines"] == [first["lines"][1]]
    assert board.log(0, after=first["next"])["lines"] == []
    assert board.log_text(0) == "a\nc\n" and board.log(5)["lines"] == []


def test_everything_kept_is_capped() -> None:
    board = Board(load_three())
    long = b"x" * (boards.MAX_LINE_CHARS * 3)
    board.many([api.RankLine(1.0, 0, "h", "out", long)] * (boards.MAX_LOG_LINES + 10))
    lines = board.log(0)["lines"]
    assert len(lines) == boards.MAX_LOG_LINES
    assert len(lines[0][1]) == boards.MAX_LINE_CHARS + 1 and lines[0][1].endswith("…")
    for _ in range(boards.MAX_EVENTS + 5):
        board(api.HostLost(1.0, "h", "why"))
    assert len(board.snapshot()["events"]) == boards.MAX_EVENTS
    gpu = GpuStatus("h", 0, "H100", 50.0, 1024.0, 81920.0, "this job", ranks=[0])
    for i in range(boards.MAX_GPU_SAMPLES + 3):
        board.gpu_sample(float(i), [gpu])
    (track,) = board.snapshot()["gpus"]
    assert len(track["samples"]) == boards.MAX_GPU_SAMPLES and track["holder"] == "this job, rank 0"
    assert track["samples"][-1] == [float(boards.MAX_GPU_SAMPLES + 2), 50.0, 1024.0, 81920.0]


def test_curves_are_thinned_and_the_latest_kept_per_rank() -> None:
    board = Board(load_three())
    points = tuple(curves.Point(i, None, float(i), None) for i in range(5000))
    series = [curves.Series("127.0.0.1", 0, "metrics.csv", "loss", points)]
    board.set_curves(series, curves.latest(series))
    snap = board.snapshot()
    (c,) = snap["curves"]
    assert len(c["points"]) <= boards.MAX_CURVE_POINTS + 1 and c["points"][-1] == [4999, None, 4999.0, None]
    assert snap["latest"] == {"127.0.0.1/0": {"loss": 4999.0}}


def load_three() -> Any:
    import tempfile
    return load(Path(inventory(Path(tempfile.mkdtemp()))))


# ---------------------------------------------------------------- served

class Running:
    """A job on the fake cluster whose ranks print a `<script>`, then run until stopped
    (every follow's channel is told when any stop arrives)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
        self.chans: list[FakeChannel] = []
        self.fake.on("follow", self.follow)
        self.default_stop = self.fake.handler("", "stop")
        self.fake.on("stop", self.stop)

    def follow(self, chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, SCRIPT + b"\n"))
        if msg.get("mode") in ("raw", "snapshot"):
            # what the log holds now, then its end, as the agent answers such a read
            # (agent/follow.finish); the fake's follow would wait for the stop (30 s)
            for r in msg["ranks"]:
                chan.push(protocol.output(r, b"rank %d up\n" % r))
            chan.push(protocol.event("done", code=None, snapshot=True))
            return
        self.chans.append(chan)
        self.fake.follow(chan, msg)

    def stop(self, chan: FakeChannel, msg: dict) -> None:
        for followed in self.chans:
            followed.stopped.set()
        self.default_stop(chan, msg)


def test_orch_dashboard_serves_the_job_behind_its_token(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    job = Running(monkeypatch)
    path = inventory(tmp_path)
    api.up(path)
    opened = page.open_for_job(path)
    try:
        fetch = Fetch(opened)
        assert opened.url.startswith("http://127.0.0.1:") and f"token={opened.server.token}" in opened.url
        assert fetch("/")[0] == 403 and fetch("/api/state")[0] == 403
        assert fetch("/?token=wrong")[0] == 403
        assert fetch("/static/app.js")[0] == 403
        assert fetch(f"/?token={opened.server.token}", host="evil.example:80")[0] == 403
        status, headers, body = fetch(f"/?token={opened.server.token}")
        assert status == 200 and b"static/app.js" in body
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert "unsafe-inline" not in headers["Content-Security-Policy"]
        cookie = headers["Set-Cookie"].split(";")[0]
        assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
        assert fetch("/static/app.js", headers={"Cookie": cookie})[0] == 200
        snap = wait_for(lambda: (s := fetch.json("/api/state"))["log_seq"] == 12 and s)
        assert [r["state"] for r in snap["ranks"]] == ["running"] * 6
        assert snap["ranks"][0]["last_line"] == "rank 0 up"
        log = fetch.json("/api/log?rank=2")
        assert [t for _, t in log["lines"]] == [SCRIPT.decode(), "rank 2 up"]
        status, headers, text = fetch("/api/log.txt?rank=2", headers={"Cookie": cookie})
        assert text.decode() == SCRIPT.decode() + "\nrank 2 up\n"
        assert headers["Content-Disposition"] == 'attachment; filename="fk-rank-2.log"'
        saved = fetch("/save", headers={"Cookie": cookie})[2].decode()
        assert "alert(1)" in saved and "<script>alert" not in saved
        assert "unsafe-inline" not in saved and "sha256-" in saved
        # a cross-site form carries the cookie at most: the stop needs the header
        assert fetch("/api/stop", "POST", headers={"Cookie": cookie})[0] == 403
        assert not job.fake.requests("stop")
        status, _, body = fetch("/api/stop", "POST", headers={"X-Orch-Token": opened.server.token})
        assert status == 200 and json.loads(body) == {"ok": True, "message": "stopped on 3 hosts"}
        assert len(job.fake.requests("stop")) >= 3
        ended = wait_for(lambda: (s := fetch.json("/api/state"))["ended"] and s)
        assert {r["state"] for r in ended["ranks"]} == {"stopped"}
        # the stop's words stay among the notes every poll redraws
        assert "stopped on 3 hosts" in ended["notes"]
    finally:
        opened.close()


def test_a_job_not_started_serves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCluster().install(monkeypatch)
    before = threading.active_count()
    with pytest.raises(api.UsageError):
        page.open_for_job(inventory(tmp_path))
    assert threading.active_count() <= before


def test_a_port_in_use_is_a_usage_error() -> None:
    board = Board(load_three())
    first = server.Dashboard(board, None).start()
    try:
        with pytest.raises(api.UsageError, match=f"port {first.port} on 127.0.0.1 is in use"):
            page.serve(board, None, first.port)
    finally:
        first.close()


def test_inline_json_cannot_end_its_script() -> None:
    text = server.inline_json({"x": "</script><script>alert(1)</script>&"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"x": "</script><script>alert(1)</script>&"}


# ---------------------------------------------------------------- orch up --dashboard, GPUs

def test_orch_up_dashboard_feeds_the_page_from_the_runs_own_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from test_controller_fake import orch
    FakeCluster().install(monkeypatch)
    seen: list[page.Opened] = []
    real = page.open_beside_run

    def kept(*a: Any, **kw: Any) -> page.Opened:
        seen.append(real(*a, **kw))
        return seen[-1]
    monkeypatch.setattr(page, "open_beside_run", kept)
    assert orch("up", "--dashboard", inventory(tmp_path)) == 0
    err = capsys.readouterr().err
    (opened,) = seen
    assert f"dashboard: {opened.url}" in " ".join(err.split())
    snap = opened.board.snapshot()
    assert snap["mode"] == "attached" and snap["outcome"] == "succeeded"
    assert [r["state"] for r in snap["ranks"]] == ["exited 0"] * 6
    kinds = [e["kind"] for e in snap["events"]]
    assert kinds[0] == "Started" and kinds[-3:] == ["Succeeded", "Pulled", "Finished"]
    with pytest.raises(OSError):   # closed with the run (stdin is no terminal here)
        http.client.HTTPConnection("127.0.0.1", opened.server.port, timeout=5).request("GET", "/")


def test_up_dashboard_with_detach_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_controller_fake import orch
    assert orch("up", "--dashboard", "--detach", inventory(tmp_path)) == 2
    assert "`up --dashboard` opens the page beside an attached run" in " ".join(capsys.readouterr().err.split())


def test_gpu_samples_are_asked_on_the_follows_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sample is one `status` on the session the follow holds, turned into GPU rows
    as `orch status` turns them; none once the job ended."""
    from orchestrator.api import querying
    from orchestrator.api.outcomes import Status
    from orchestrator.dashboard import feeds as feeding
    board = Board(load_three())
    asked: list[object] = []

    class Session:
        def status(self) -> str:
            asked.append(self)
            return "reply"
    session = Session()
    gpu = GpuStatus("127.0.0.1", 1, "H100", 97.0, 60000.0, 81559.0, "job", job="other", user="ann")
    monkeypatch.setattr(querying, "status_of", lambda s, st, reply: (
        Status("fk", [], {}, gpus=[gpu], gpu_errors={"127.0.0.3": "nvidia-smi failed"})
        if s is session and reply == "reply" else None))
    feeds = feeding.Feeds(board)
    feeds.start("gpus", lambda: feeding.sample_gpus(session, None, board, feeds, 0.05))  # type: ignore[arg-type]
    track = wait_for(lambda: len((g := board.snapshot()["gpus"]) and g[0]["samples"]) >= 3 and g[0])
    assert track["holder"] == "job other (user ann)" and track["samples"][0][1:] == [97.0, 60000.0, 81559.0]
    assert board.snapshot()["gpu_errors"] == {"127.0.0.3": "nvidia-smi failed"}
    board.end()
    time.sleep(0.2)
    count = len(asked)
    time.sleep(0.3)
    assert len(asked) == count, "no sample once the job ended"
    feeds.close()


def test_the_orch_dashboard_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The URL printed (and --json's document), the page served behind it until Ctrl-C:
    exit 130, the port closed after."""
    import re

    from orchestrator.commands import dashboard as command
    from test_controller_fake import orch
    Running(monkeypatch)
    path = inventory(tmp_path)
    api.up(path)
    capsys.readouterr()
    seen: dict[str, Any] = {}

    def held() -> None:
        out, err = capsys.readouterr()
        seen["doc"], seen["err"] = json.loads(out), " ".join(err.split())
        port, token = re.search(r"127\.0\.0\.1:(\d+)/\?token=(\S+)", seen["err"]).groups()  # type: ignore[union-attr]
        conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=30)
        conn.request("GET", f"/api/state?token={token}")
        seen["state"] = json.loads(conn.getresponse().read())
        conn.close()
        raise KeyboardInterrupt
    monkeypatch.setattr(command, "hold", held)
    assert orch("dashboard", "--json", "-c", path) == 130
    assert seen["doc"]["url"] in seen["err"] and seen["doc"]["version"] == 1
    assert "Ctrl-C ends it" in seen["err"] and len(seen["state"]["ranks"]) == 6
    assert "dashboard closed" in capsys.readouterr().err
    with pytest.raises(OSError):
        http.client.HTTPConnection("127.0.0.1", seen["doc"]["port"], timeout=5).request("GET", "/")


def test_orch_dashboard_without_a_job_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from test_controller_fake import orch
    FakeCluster().install(monkeypatch)
    assert orch("dashboard", "-c", inventory(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "orch: " in err and "Traceback" not in err and "dashboard:" not in err


def test_the_big_parts_are_sent_only_when_they_changed() -> None:
    board = Board(load_three())
    first = board.snapshot()
    assert {"events", "gpus", "curves", "tasks"} <= first.keys()
    again = board.snapshot(first["versions"])
    assert not {"events", "gpus", "curves", "tasks"} & again.keys() and len(again["ranks"]) == 6
    board(api.HostLost(1.0, "127.0.0.1", "gone"))
    board.set_curves([], {})   # unchanged: no new version
    later = board.snapshot(first["versions"])
    assert "events" in later and "curves" not in later and later["ranks"][0]["state"] == "lost"


@pytest.mark.slow
def test_the_wheel_ships_the_page_and_its_scripts(tmp_path: Path) -> None:
    """Offline: every script and style the page loads is package data in the wheel."""
    import re
    import shutil
    import subprocess
    import sys
    import zipfile
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    shutil.copytree(root / "orchestrator", src / "orchestrator",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(src)], check=True, timeout=600)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    page_text = server.static("index.html").decode()
    loaded = re.findall(r'(?:src|href)="static/([^"]+)"', page_text)
    assert set(loaded) == {"uPlot.min.css", "app.css", "uPlot.iife.min.js", "app.js"}
    for name in (*loaded, "index.html", "uPlot.LICENSE"):
        assert f"orchestrator/dashboard/static/{name}" in names
    assert not re.search(r'(?:src|href)="(?:https?:)?//', page_text), "nothing from the network"


ARRAY = """name: arr
hosts:
  - {address: 127.0.0.1, connection: local, remote_dir: /r1, procs: 2}
code: {paths: [job.py]}
job:
  entrypoint: job.py
  array:
    matrix: {model: [lenet, vgg], fold: [0, 1]}
"""


def array_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """`orch results` of ARRAY's four tasks (two models, two folds), every one exited 0;
    the inventories it was asked for (every 0.05 s)."""
    from orchestrator.api.outcomes import MetricStats, ResultGroup, Results, TaskResult
    asked: list[object] = []

    def results(inventory: object) -> Results:
        asked.append(inventory)
        tasks = [TaskResult(i, f"--model m{i // 2} --fold {i % 2}", {"model": f"m{i // 2}", "fold": str(i % 2)},
                            "exited 0", {"val_acc": "0.9"}) for i in range(4)]
        groups = [ResultGroup({"model": f"m{g}"}, [2 * g, 2 * g + 1], 2,
                              {"val_acc": MetricStats(0.9, 0.0, 2)}) for g in range(2)]
        return Results("arr", tasks, groups, tmp_path / "results.csv")
    monkeypatch.setattr(api, "results", results, raising=False)
    monkeypatch.setattr("orchestrator.dashboard.feeds.TASKS_EVERY", 0.05)
    return asked


def test_a_job_arrays_tasks_and_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`orch dashboard` of an array: `orch results`'s rows (tasks, groups over folds), asked
    before anything is served and again while the page is open."""
    asked = array_results(tmp_path, monkeypatch)
    path = inventory(tmp_path, ARRAY)
    opened = page.open_for_job(path)
    try:
        assert opened.board.snapshot()["ranks"] == []   # an array's rows are its tasks
        tasks: Any = opened.board.snapshot()["tasks"]   # api.document's JSON, as the page reads it
        assert [t["task"] for t in tasks["tasks"]] == [0, 1, 2, 3] and tasks["tasks"][3]["state"] == "exited 0"
        assert [g["tasks"] for g in tasks["groups"]] == [[0, 1], [2, 3]]
        wait_for(lambda: len(asked) >= 3)
        # each task's curves carry the task (its folder task-<i>/), for the page to group
        for t in (1, 3):
            (tmp_path / "outputs" / "arr" / f"task-{t}").mkdir(parents=True)
            (tmp_path / "outputs" / "arr" / f"task-{t}" / "metrics.csv").write_text("epoch,loss\n0,1\n1,0.5\n")
        got = wait_for(lambda: len(c := opened.board.snapshot()["curves"]) == 2 and c)
        assert sorted((c["task"], c["source"]) for c in got) == [(1, "task-1/metrics.csv"), (3, "task-3/metrics.csv")]
    finally:
        opened.close()


def test_a_hang_marks_the_culprit_and_keeps_every_stack(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from test_run_events import HANG, hung_follow, run, stacks
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    fake.on("follow", hung_follow(threading.Event())).on("stacks", stacks)
    path = inventory(tmp_path, HANG)
    events, err = run(path, pull=False)
    assert isinstance(err, api.JobError)
    board = Board(load(Path(path)))
    board.many(events)
    snap = board.snapshot()
    assert [r["rank"] for r in snap["ranks"] if r["hung"]] == [3]
    cause = snap["root_cause"]
    assert cause is not None and cause["kind"] == "hang" and snap["outcome"] == "failed"
    (hang,) = [e for e in snap["events"] if e["kind"] == "Hang"]
    assert "rank 3 on 127.0.0.2" in hang["text"] and "train_step" in hang["detail"]


def test_a_restart_on_a_spare_moves_the_ranks_and_counts(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.api import healing
    from test_controller_fake import SPARE, lost_for_good
    from test_run_events import run
    monkeypatch.setattr(healing, "backoff", lambda attempt: 0.0)
    fake = FakeCluster(lambda label, rank, env: (
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    lost_for_good(fake, "127.0.0.2")
    path = inventory(tmp_path, SPARE)
    events, err = run(path, restarts=1, pull=False)
    assert err is None
    board = Board(load(Path(path)))
    board.many(events)
    snap = board.snapshot()
    assert {r["host"] for r in snap["ranks"]} == {"127.0.0.1", "127.0.0.9", "127.0.0.3"}
    assert [r["state"] for r in snap["ranks"]] == ["exited 0"] * 6
    assert {r["restarts"] for r in snap["ranks"]} == {1} and snap["outcome"] == "succeeded"
    texts = [e["text"] for e in snap["events"]]
    assert any(t.startswith("restart 1 of 1") and "127.0.0.9" in t for t in texts)
    assert "spares ready: 127.0.0.9" in texts


def test_the_next_run_is_followed_once_the_first_ended(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`orch dashboard` stays on the job: stopped, then started again by another `orch
    up`, the page follows the new run's ranks."""
    from orchestrator.dashboard import feeds as feeding
    monkeypatch.setattr(feeding, "NEXT_RUN_EVERY", 0.1)
    Running(monkeypatch)
    path = inventory(tmp_path)
    api.up(path)
    opened = page.open_for_job(path)
    try:
        board = opened.board
        wait_for(lambda: [r["state"] for r in board.snapshot()["ranks"]] == ["running"] * 6)
        api.stop(path)
        wait_for(lambda: board.snapshot()["ended"])
        assert {r["state"] for r in board.snapshot()["ranks"]} == {"stopped"}
        api.up(path)
        again = wait_for(lambda: (s := board.snapshot())["log_seq"] >= 24 and not s["ended"] and s)
        assert [r["state"] for r in again["ranks"]] == ["running"] * 6 and again["root_cause"] is None
        assert any(e["kind"] == "Followed" for e in again["events"])
    finally:
        opened.close()


def test_a_broken_request_prints_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """A bad Content-Length, a browser gone mid-answer: nothing on the run's terminal."""
    import socket
    dash = server.Dashboard(Board(load_three()), None).start()
    try:
        with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
            s.sendall(f"POST /api/stop HTTP/1.1\r\nHost: 127.0.0.1:{dash.port}\r\nX-Orch-Token: "
                      f"{dash.token}\r\nContent-Length: lots\r\n\r\n".encode())
            assert b" 200 " in s.recv(65536).split(b"\r\n")[0]
        with socket.create_connection(("127.0.0.1", dash.port), timeout=10) as s:
            s.sendall(f"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1:{dash.port}\r\nX-Orch-Token: "
                      f"{dash.token}\r\n\r\n".encode())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        time.sleep(0.3)
    finally:
        dash.close()
    out, err = capfd.readouterr()
    assert "Traceback" not in err and not out


def test_orch_dashboard_sets_an_earlier_runs_files_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """outputs/fk/ holding the previous run's files: `orch dashboard` of the new run moves
    them to outputs/fk.<when>/ as the pull would, says so on the terminal and the page,
    and its curves are the new run's only."""
    from orchestrator.api import pulling
    from orchestrator.commands import dashboard as command
    from orchestrator.session import state as job_state
    from test_controller_fake import orch
    Running(monkeypatch)
    path = inventory(tmp_path)
    cluster = load(Path(path))
    api.up(path)
    first = job_state.load(cluster)
    assert first is not None
    pulling.adopt(cluster, first)     # outputs/fk/ is the first run's
    out = tmp_path / "outputs" / "fk"
    out.mkdir(parents=True)
    (out / "metrics.csv").write_text("epoch,old_loss\n0,9\n1,8\n")
    api.stop(path)
    api.up(path)
    capsys.readouterr()
    seen: dict[str, Any] = {}

    def held() -> None:
        seen["err"] = " ".join(capsys.readouterr().err.split())
        (tmp_path / "outputs" / "fk").mkdir(exist_ok=True)
        (tmp_path / "outputs" / "fk" / "metrics.csv").write_text("epoch,new_loss\n0,1\n")
        seen["state"] = wait_for(lambda: (s := seen["board"].snapshot())["curves"] and s)
        raise KeyboardInterrupt
    real = page.open_for_job

    def kept(*a: Any, **kw: Any) -> page.Opened:
        opened = real(*a, **kw)
        seen["board"] = opened.board
        return opened
    monkeypatch.setattr(command, "hold", held)
    monkeypatch.setattr(page, "open_for_job", kept)
    assert orch("dashboard", "--no-open", "-c", path) == 130
    (aside,) = (tmp_path / "outputs").glob("fk.*")
    assert (aside / "metrics.csv").read_text().startswith("epoch,old_loss")
    said = f"outputs/fk/ held an earlier run's files: moved to outputs/{aside.name}/ (each run keeps its own folder)"
    assert said in seen["err"] and said in seen["state"]["notes"]
    assert [c["name"] for c in seen["state"]["curves"]] == ["new_loss"]


def test_the_network_plan_is_a_table_with_identical_hosts_folded() -> None:
    """The plan `up` saved, as rows: the master and how it was chosen, then each group of
    identical hosts with its interface, addresses, findings and the variables set; every
    value text, whatever the file holds."""
    board = Board(load_three())
    env = {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    trap = "hostname resolves to 127.0.1.1 (loopback): gloo alone would advertise it to the other hosts"
    hosts: list[object] = [{"host": f"gpu0{i}", "interface": "eth0", "how": "auto", "address": f"10.1.0.{i}",
              "found": [trap], "set": env} for i in range(1, 4)]
    hosts.append({"host": "<b>x</b>", "interface": None, "how": "one machine", "address": "",
                  "found": "not a list", "set": ["not a dict"]})
    board.set_network(cast(PlanDoc, {"master_addr": "10.1.0.1", "how": "the inventory's address",
                                     "probe": "p", "hosts": [*hosts, "junk"]}))   # as network.load passes it on
    plan = board.snapshot()["network"]
    assert plan is not None
    assert plan["master_addr"] == "10.1.0.1" and plan["how"] == "the inventory's address"
    first, other = plan["rows"]
    assert first == {"hosts": "gpu[01-03]", "addresses": "10.1.0.[1-3]", "interface": "eth0",
                     "how": "auto", "found": [trap],
                     "set": ["GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0"]}
    assert other["hosts"] == "<b>x</b>" and other["interface"] == "left to torch"
    assert other["found"] == [] and other["set"] == []
    board.set_network(None)
    assert board.snapshot()["network"] is None


LINES = 6000    # more than the board keeps (MAX_LOG_LINES)


def test_download_streams_the_ranks_whole_log_from_its_host(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """*download*: rank 2's whole log, read on its host as `orch logs --rank 2` reads it
    (the board keeps its newest 5,000 lines), behind the token, under a safe file name;
    a rank outside the job is one message."""
    job = Running(monkeypatch)
    raw = b"".join(b"line %d of rank 2\n" % i for i in range(LINES))

    def follow(chan: FakeChannel, msg: dict) -> None:
        if msg.get("mode") != "raw":
            return job.follow(chan, msg)
        assert msg["ranks"] == [2] and msg["tail"] == page.MAX_DOWNLOAD_LINES
        for at in range(0, len(raw), 50_000):
            chan.push(protocol.output(2, raw[at:at + 50_000], partial=True))
        chan.push(protocol.event("done", code=0, time=time.time()))
    job.fake.on("follow", follow)
    path = inventory(tmp_path)
    api.up(path)
    opened = page.open_for_job(path)
    try:
        fetch = Fetch(opened)
        assert fetch("/api/log.txt?rank=2")[0] == 403
        status, headers, body = fetch("/api/log.txt?rank=2", headers={"X-Orch-Token": opened.server.token})
        assert status == 200 and body == raw and len(body.splitlines()) == LINES > boards.MAX_LOG_LINES
        assert headers["Content-Disposition"] == 'attachment; filename="fk-rank-2.log"'
        status, _, body = fetch("/api/log.txt?rank=99", headers={"X-Orch-Token": opened.server.token})
        assert status == 400 and b"rank 99" in body and b"Traceback" not in body
    finally:
        opened.close()


def test_a_download_is_cut_at_its_cap_and_says_so() -> None:
    got: list[bytes] = []
    sink = page.Capped(got.append, cap=10)
    sink.output(0, 2, False, b"0123456\n")
    sink.output(0, 2, False, b"789abc\n")
    assert b"".join(got) == b"0123456\n78" and sink.cut and sink.ended.is_set()
    sink.output(0, 2, False, b"more\n")
    assert b"".join(got) == b"0123456\n78"


@pytest.mark.parametrize("name", ["fk", "../../etc/passwd", '"; x="y', "a\r\nSet-Cookie: x", ".hidden",
                                  "gpu[01-04] é", ""])
def test_a_download_name_is_safe_for_any_job(name: str) -> None:
    safe = server.safe_name(name + "-rank-0.log")
    assert safe and not safe.startswith(".") and len(safe) <= 120
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in safe), safe
