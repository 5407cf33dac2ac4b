"""What a user sees: hints that work as printed, counts, --json documents, the status
table at 80 columns, host text that can neither drive the terminal nor be read as rich
markup, the live "ranks started" line, and the host's stop record."""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from fake_agent import session_maker
from helpers import orch_in_process
from orchestrator.agent import launch as host_launch
from orchestrator.agent import procs as host_procs
from orchestrator.agent import status as host_status
from orchestrator.agent.common import job_paths
from orchestrator.api import jobs as api_jobs
from orchestrator.api.querying import rank_status
from orchestrator.commands import logs as logs_cmd
from orchestrator.commands import status as status_cmd
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_HOST, EXIT_JOB_FAILED
from orchestrator.session.replies import RankReply, Supervisor
from orchestrator.session.state import HostState, JobState
from orchestrator.ui import console as ui_console
from orchestrator.ui.liveline import ERASE, LiveLine, started_text
from orchestrator.ui.wording import hint_cmd, plural
from orchestrator.watch.follow import PrefixPrinter
from orchestrator.wire import protocol

SUP = Supervisor(1, 1, None, 2, "run", 0.0)   # a launched host's supervisor

INVENTORY = """name: ux
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: localhost, connection: local, remote_dir: /r1, procs: 2}
job: {entrypoint: job.py}
"""


# ---------------------------------------------------------------- words

def test_plural() -> None:
    assert [plural(1, "host"), plural(2, "host"), plural(0, "rank")] == [
        "1 host", "2 hosts", "0 ranks"]
    assert plural(1, "process") == "1 process" and plural(3, "process") == "3 processes"


def test_hint_keeps_the_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    default = parse(INVENTORY, tmp_path / "cluster.yaml")
    other = parse(INVENTORY, tmp_path / "runs" / "b.yaml")
    away = parse(INVENTORY, Path("/elsewhere/c c.yaml"))
    assert hint_cmd(default, "logs --rank 2") == "orch logs --rank 2"
    assert hint_cmd(other, "logs --rank 2") == "orch logs -c runs/b.yaml --rank 2"
    assert hint_cmd(away, "stop") == "orch stop -c '/elsewhere/c c.yaml'"


# ---------------------------------------------------------------- --json

def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return orch_in_process(cwd, *args)


def test_json_errors_are_documents_with_the_same_exit_code(tmp_path: Path) -> None:
    for args in (("status", "--json", "-c", "missing.yaml"), ("stop", "--json", "--bogus"),
                 ("logs", "--list", "--json")):
        r = run_cli(tmp_path, *args)
        doc = json.loads(r.stdout)
        assert r.returncode == 2 and doc["exit_code"] == 2 and doc["error"], (args, r)
        assert r.stderr.startswith(("orch: ", "usage: ")) and "Traceback" not in r.stderr


def test_logs_before_any_run_exits_2_with_a_working_hint(tmp_path: Path) -> None:
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    r = run_cli(tmp_path, "logs", "--rank", "0")
    assert r.returncode == 2 and "has not been started" in r.stderr and "`orch up`" in r.stderr, r


# ---------------------------------------------------------------- status

def rows_of(last_line: str) -> list:
    info = RankReply.of({"rank": 0, "state": "exited", "code": -15, "pid": 4242,
                         "started": 1.0, "ended": 20.5, "last_line": last_line})
    return [rank_status(r, f"worker-node-{r:02d}.example.com", r % 2, info, 0.0)
            for r in range(4)]


@pytest.mark.parametrize("width", [80, 140])
def test_status_table_one_row_per_rank_start_of_line_kept(width: int) -> None:
    line = "epoch 3/5 step 120 loss 0.2345 " * 6
    buf = io.StringIO()
    console = Console(width=width, file=buf, color_system=None)
    console.print(status_cmd.table("ux", rows_of(line), width), soft_wrap=False, crop=True)
    out = buf.getvalue().splitlines()
    body = [row for row in out if row.startswith("│")]
    assert len(body) == 4, "\n".join(out)
    assert all("epoch 3/5" in row and row.rstrip().endswith("│") for row in body)
    assert max(len(row) for row in out) <= width


def test_status_shows_markup_and_escapes_literally() -> None:
    buf = io.StringIO()
    console = Console(width=200, file=buf, color_system=None)
    console.print(status_cmd.table("ux", rows_of("[/bold] \x1b]0;title\x07 done"), 200))
    text = buf.getvalue()
    assert "[/bold] \\x1b]0;title\\x07 done" in text and "\x1b" not in text


# what a host's agent says of each rank (raw: "exited" with its code, as agent/status.py
# answers), so that the states a test reads are the controller's own words
RAW = {0: {"state": "exited", "code": 0}, 1: {"state": "exited", "code": 3},
       2: {"state": "exited", "code": -15}, 3: {"state": "stopped", "code": -15}}


def fake_sessions(tmp_path: Path, last_line: str, down: int | None, raw: bool = False,
                         codes: dict[int, int] | None = None):
    """open_session for commands: in-process agents; host `down` cannot be reached.
    `raw`: each rank as RAW says, its log 10 + rank bytes long; `codes`: the ranks that
    exited with that code (the others were stopped)."""
    codes = codes or {}

    def status(chan, msg: dict) -> None:
        ranks = [dict({"rank": r, "state": "exited" if r in codes else "stopped",
                       "last_line": last_line, "pid": 7, "code": codes.get(r, -15),
                       "log_bytes": 11},
                      **(dict(RAW[r], log_bytes=10 + r, pid=100 + r) if raw else {}))
                 for r in msg["ranks"]]
        chan.push(protocol.reply(msg["id"], {"supervisor": None, "host_exit": None,
                                             "time": time.time(), "ranks": ranks}))

    return session_maker({"status": status}, down)


def state_of(cluster) -> JobState:
    return JobState("ux", "run", "cluster.yaml", 0.0, 4, "127.0.0.1", 29500,
                    [HostState(h.index, h.label, f"/r{h.index}/ux", list(h.ranks), 0.0, SUP)
                     for h in cluster.hosts])


def command_args(tmp_path: Path, **kw) -> argparse.Namespace:
    return argparse.Namespace(config=str(tmp_path / "cluster.yaml"), file=None, **kw)


@pytest.fixture
def fake_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    cluster = parse(INVENTORY, tmp_path / "cluster.yaml")
    monkeypatch.setattr(api_jobs, "saved_state", lambda c: state_of(c))

    def use(last_line: str = "", down: int | None = None, raw: bool = False,
            codes: dict[int, int] | None = None) -> None:
        # every api call opens its sessions through api.jobs (open_job too)
        monkeypatch.setattr(api_jobs, "new_session",
                            fake_sessions(tmp_path, last_line, down, raw, codes))
    return cluster, use


def test_status_markup_last_line_and_unreachable_host_exit_3(tmp_path: Path, fake_job,
                                                              capsys) -> None:
    _, use = fake_job
    use(last_line="[/bold]", down=1)
    code = status_cmd.run(command_args(tmp_path, json=False))
    out, err = capsys.readouterr()
    assert code == EXIT_HOST
    assert out.count("[/bold]") == 2 and "stopped" in out, out     # host 0's ranks, literally
    assert out.count("unreachable") == 2 and "connection refused" in err, (out, err)
    assert "connection refused" not in out and "unreachable" not in err, (out, err)


def test_status_and_logs_list_tables_go_to_stdout(tmp_path: Path, fake_job, capsys) -> None:
    """The table is the answer: `orch status > f` and `| grep` see it; warnings stay on
    stderr."""
    _, use = fake_job
    use(last_line="last words", down=1)
    assert status_cmd.run(command_args(tmp_path, json=False)) == EXIT_HOST
    out, err = capsys.readouterr()
    assert out.count("stopped") == 2 and "last words" in out and "job ux" in out, out
    assert "warning:" in err and "stopped" not in err, err
    assert logs_cmd.run(command_args(tmp_path, json=False, list=True, rank=None, task=None,
                                     follow=False, tail=-1)) == EXIT_HOST
    out, err = capsys.readouterr()
    assert out.count("stopped") == 2 and "11 B" in out and "4 ranks" in out, out
    assert "warning:" in err and "stopped" not in err, err


@pytest.mark.parametrize("width", [60, 80])
def test_status_after_a_crash_piped_keeps_the_state_whole_and_exits_1(
        tmp_path: Path, fake_job, capsys, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """Piped (rich's 80 columns), the state is never cut; the failure is summed up on
    stderr and the exit code is 1 (the job failed), with --json too."""
    _, use = fake_job
    monkeypatch.setattr(ui_console.out, "_width", width)
    use(last_line="Traceback (most recent call last): " * 3, codes={2: 1, 3: -9})
    assert status_cmd.run(command_args(tmp_path, json=False)) == EXIT_JOB_FAILED
    out, err = capsys.readouterr()
    assert out.count("failed (exit code 1)") == 1 and out.count("failed (killed by SIGKILL)") == 1, out
    assert max(len(line) for line in out.splitlines()) <= width, out
    assert err.strip() == ("2 of 4 ranks failed: rank 2 on localhost#1 (exit code 1), "
                           "rank 3 on localhost#1 (killed by SIGKILL)"), err
    assert status_cmd.run(command_args(tmp_path, json=True)) == EXIT_JOB_FAILED
    use(last_line="ok")
    assert status_cmd.run(command_args(tmp_path, json=False)) == 0
    assert "failed" not in capsys.readouterr().err


def test_status_and_logs_list_json(tmp_path: Path, fake_job, capsys) -> None:
    _, use = fake_job
    """The hosts say "exited" and a code; the documents carry the controller's states,
    each rank's own pid and log size, in rank order across the hosts."""
    use(last_line="ok", raw=True)
    assert status_cmd.run(command_args(tmp_path, json=True)) == EXIT_JOB_FAILED   # rank 1 failed
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["host"], r["state"], r["code"], r["pid"]) for r in doc["ranks"]] == [
        (0, "localhost#0", "exited 0", 0, 100), (1, "localhost#0", "failed (exit code 3)", 3, 101),
        (2, "localhost#1", "failed (killed by SIGTERM)", -15, 102),
        (3, "localhost#1", "stopped", -15, 103)]
    assert doc["unreachable"] == {}
    use(down=0, raw=True)
    assert logs_cmd.run(command_args(tmp_path, json=True, list=True, rank=None,
                                     follow=False, tail=-1)) == EXIT_HOST
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["state"], r["log_bytes"]) for r in doc["ranks"]] == [
        (0, "unreachable", None), (1, "unreachable", None),
        (2, "failed (killed by SIGTERM)", 12), (3, "stopped", 13)]


# ---------------------------------------------------------------- rank output

NASTY = [b"\x1b]0;pwned\x07title", b"50%\r[r9 evil] forged", b"[/bold] \x1b[31mred\x1b[0m"]


def test_prefixed_output_on_a_terminal_is_escaped() -> None:
    out = io.BytesIO()
    PrefixPrinter({0: "h0"}, out=out, tty=True).lines(0, 1, NASTY)
    got = out.getvalue()
    assert b"\\x1b]0;pwned\\x07title" in got and b"50%\\r[r9 evil] forged" in got
    assert b"\x07" not in got and b"\r" not in got and b"\x1b[31mred" in got   # colours stay


def test_prefixed_output_piped_is_byte_exact_after_the_prefix() -> None:
    out = io.BytesIO()
    PrefixPrinter({0: "h0"}, out=out, tty=False).lines(0, 1, NASTY)
    assert out.getvalue() == b"".join(b"[r1 h0] " + t + b"\n" for t in NASTY)


def test_raw_log_piped_is_byte_exact_terminal_escaped() -> None:
    data = b"".join(t + b"\n" for t in NASTY) + b"\xff\xfe bytes\n"
    piped, tty = logs_cmd.RawSink(tty=False), logs_cmd.RawSink(tty=True)
    piped.out, tty.out = io.BytesIO(), io.BytesIO()
    for sink in (piped, tty):
        sink.output(0, 0, False, data)
    assert piped.out.getvalue() == data
    assert b"\x07" not in tty.out.getvalue() and b"\\xff\\xfe" in tty.out.getvalue()
    assert tty.out.getvalue().count(b"\n") == data.count(b"\n")


# ---------------------------------------------------------------- live line

class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_live_line_steps_aside_for_output() -> None:
    err = FakeTty()
    live = LiveLine(err)
    live.update("ranks started 1/4")
    with live.above():
        err.write("<output>")
    live.close()
    assert err.getvalue() == (ERASE + "ranks started 1/4" + ERASE + "<output>" + ERASE
                              + "ranks started 1/4" + ERASE)
    silent = io.StringIO()
    quiet = LiveLine(silent)     # not a terminal: nothing at all
    quiet.update("x")
    with quiet.above():
        pass
    quiet.close()
    assert silent.getvalue() == ""


def test_started_text_counts_per_host_and_abbreviates() -> None:
    assert started_text([("h1", 2, 2), ("h2", 0, 2)], 1) == \
        "ranks started 2/4: h1 2/2, h2 0/2; first output 1/4"
    many = [(f"h{i}", 1, 1) for i in range(9)] + [("slow", 0, 1)]
    text = started_text(many, 0)
    assert text.startswith("ranks started 9/10: slow 0/1, h0 1/1") and "(+2 hosts)" in text


# ---------------------------------------------------------------- host side

def host_job(tmp_path: Path) -> dict:
    root = tmp_path / "job"
    for d in ("run", "logs", "code", "output", "data"):
        (root / d).mkdir(parents=True, exist_ok=True)
    return job_paths(str(root))


def test_last_line_skips_trailing_empty_lines(tmp_path: Path) -> None:
    p = host_job(tmp_path)
    Path(p["logs"], "rank-0.log").write_bytes(b"first\nlast words\n\n  \n")
    Path(p["logs"], "rank-1.log").write_bytes(b"")
    assert host_status.last_line(p["jd"], "logs/rank-0.log") == "last words"
    assert host_status.last_line(p["jd"], "logs/rank-1.log") == ""


def test_a_rank_ended_by_a_stop_reads_stopped(tmp_path: Path) -> None:
    p = host_job(tmp_path)
    run = Path(p["run"])
    (run / "rank-0.exit").write_text(json.dumps({"code": 7, "time": 100.0}))    # failed first
    (run / "rank-1.exit").write_text(json.dumps({"code": -15, "time": 105.0}))  # then stopped
    assert host_status.rank_status(p, 1, 1, None)["state"] == "exited"
    host_procs.mark_stop(p, 101.0)
    assert host_status.rank_status(p, 0, 0, None)["state"] == "exited"
    assert host_status.rank_status(p, 1, 1, None)["state"] == "stopped"
    info = host_status.rank_status(p, 1, 1, None)
    assert rank_status(1, "h", 1, RankReply.of(info), 0).state == "stopped"


def test_launch_clears_the_previous_runs_records(tmp_path: Path) -> None:
    p = host_job(tmp_path)
    old = Path(p["run"], "torchrun", "none_abc", "attempt_0", "0")
    old.mkdir(parents=True)
    (old / "error.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    os.symlink(outside, Path(p["run"], "torchrun", "none_link"))
    Path(p["run"], "stop.json").write_text('{"time": 1}')
    host_launch.clean_run_dir(p)
    assert not Path(p["run"], "torchrun").exists() and not Path(p["run"], "stop.json").exists()
    assert (outside / "keep").exists()


def test_a_pull_of_one_file_says_file(capsys: pytest.CaptureFixture[str]) -> None:
    """`pulled 1 file`, not `pulled 1 files` (and the up-to-date line alike)."""
    import dataclasses

    from orchestrator.api.outcomes import PullResult
    from orchestrator.commands import render
    one = PullResult(host="h", source="output", destination="/tmp/o", files=1, bytes=10,
                     unchanged=0, listed=1, skipped=[], skipped_count=0, failed=[])
    render.pulled(one)
    render.pulled(dataclasses.replace(one, files=0, unchanged=1))
    err = capsys.readouterr().err
    assert "pulled 1 file (" in err and "is up to date (1 file)" in err, err


def test_a_warning_keeps_its_fix_on_its_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A host that is down, in `status`: its error and its fix, two lines, no literal `\\n`;
    host text still escaped."""
    from orchestrator.commands.common import warn_unreachable
    from orchestrator.errors import HostError
    warn_unreachable([HostError("10.0.0.9: connection refused \x1b[2J", hint="start sshd")])
    err = capsys.readouterr().err
    assert err == "warning: 10.0.0.9: connection refused \\x1b[2J\n  fix: start sshd\n", err


def test_logs_follow_ended_by_sigterm_says_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM (Ctrl-C) ends `orch logs -f`: the connections orch closes itself are not
    reported as lost hosts (three warnings, the host named twice, before): one line."""
    from fake_agent import session_maker as factory
    from orchestrator import cli
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(api_jobs, "saved_state", lambda c: state_of(c))

    def follow(chan, msg: dict) -> None:   # a line per rank, then the job runs on
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
    monkeypatch.setattr(api_jobs, "new_session", factory({"follow": follow}))
    from orchestrator.commands import logs
    from orchestrator.watch.follow import PrefixPrinter
    shown: list[int] = []

    class Printer(PrefixPrinter):   # logs -f renders the job's events with it
        def print_as(self, label: str, rank: int, texts: list[bytes]) -> None:
            super().print_as(label, rank, texts)
            shown.append(rank)
            if len(shown) == 4:   # the lines are in: the signal arrives (cli turns it into this)
                raise KeyboardInterrupt
    monkeypatch.setattr(logs, "PrefixPrinter", Printer)
    assert cli.cli(["logs", "-f"]) == 130
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == [f"[r{r} localhost#{r // 2}] rank {r} up" for r in range(4)], out
    assert err == "orch: interrupted\n", err
