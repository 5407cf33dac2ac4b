"""The tutorial's small points: `orch stop` says once what it did, and the progress bars
leave nothing in a redirected stderr."""
from __future__ import annotations

import subprocess
import sys

from orchestrator.api.outcomes import StopResult
from orchestrator.commands.stop import summary
from orchestrator.session.stopper import StopReport

IDLE, BUSY = StopReport(0, 0, (), 0.1), StopReport(6, 0, (), 0.4)


def test_stop_says_once_that_nothing_was_running() -> None:
    result = StopResult(job="hello", hosts={"a": IDLE, "b": IDLE}, failed={})
    assert summary("hello", result) == "job 'hello': nothing was running on 2 hosts"


def test_stop_counts_only_the_hosts_it_stopped() -> None:
    both = StopResult(job="hello", hosts={"a": BUSY, "b": BUSY}, failed={})
    assert summary("hello", both) == "job 'hello' stopped on 2 hosts"
    one = StopResult(job="hello", hosts={"a": BUSY, "b": IDLE}, failed={})
    assert summary("hello", one) == \
        "job 'hello' stopped on 1 host (nothing was running on 1 other host)"


def test_a_redirected_stderr_does_not_start_with_an_empty_line() -> None:
    code = ("from orchestrator.ui.console import bytes_bar, hosts_bar, console\n"
            "for bar in (hosts_bar(), bytes_bar()):\n"
            "    with bar:\n"
            "        bar.update(bar.add_task('x', total=2), advance=1)\n"
            "console.print('first line')\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert got.stderr == "first line\n", got.stderr


def test_pull_names_an_earlier_runs_files() -> None:
    from orchestrator.api.pulling import Older, describe
    one = describe("10.0.0.8", 1000.0, Older(1, [("result.txt", 900.0)]))
    assert one.startswith("result.txt was written at ") and "an earlier run's file" in one
    assert "before this run started on 10.0.0.8 (" in one
    many = describe("h", 1000.0, Older(7, [(f"f{i}", 900.0) for i in range(7)]))
    assert many.startswith("7 files were written before this run started on h")
    assert "f4 (" in many and "f5 (" not in many and "2 more" in many


def test_pull_says_whose_host_it_is() -> None:
    from orchestrator.api.pulling import run_start, whose
    from orchestrator.config.inventory import parse
    text = ("name: t\nhosts:\n  - {address: a, procs: 2}\n  - {address: b, procs: 2}\n"
            "job:\n  entrypoint: train.py\n")
    cluster = parse(text, "cluster.yaml")
    a, b = cluster.hosts
    assert whose(b, 2) == "rank 2's host" and whose(a, None) == "rank 0's host"
    assert whose(b, None) == "ranks 2-3"
    assert run_start(None, a) is None


def test_a_reply_late_past_the_shared_bound_is_named_with_the_bound() -> None:
    """ask_all awaits every host's reply against one deadline: a late host's wait is
    what is left of it, and its error names the whole bound, not that remainder; the
    host that answered is still in the result, and one whose link is gone too."""
    from types import SimpleNamespace

    from orchestrator.errors import HostError
    from orchestrator.remote.ask import ask_all
    from orchestrator.remote.link import Link, Pending

    def host(name: str, body: dict | None, gone: bool = False) -> SimpleNamespace:
        link = SimpleNamespace(name=name)
        link.wait = lambda p, timeout, bound=None: Link.wait(link, p, timeout, bound)  # type: ignore[arg-type]

        def submit(command: str, **fields) -> tuple[int, Pending]:
            if gone:
                raise HostError(f"{name}: connection lost")
            got = Pending(command, body=body)
            if body is not None:
                got.done.set()
            return 1, got
        link.submit = submit
        return link
    links = {0: host("h0", None), 1: host("h1", {"found": 0}), 2: host("h2", None, gone=True)}
    result = ask_all(links, "stop", lambda i: {"grace": 1}, 0.05, dict)  # type: ignore[arg-type]
    assert result.ok == {1: {"found": 0}} and list(result.failed) == [0, 2]
    assert str(result.failed[0]).startswith("h0: no answer to `stop` within 0.05 s\n")
    assert "connection lost" in str(result.failed[2])
