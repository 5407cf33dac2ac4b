"""The `orch` command line itself: help, usage errors, a missing inventory, both entry
points (the `orch` console script and `python -m orchestrator`). No host is contacted.
Most tests run orch's `cli()` in process (the same parser and messages, without a new
interpreter's imports); the entry points and what a start imports are tested on new processes."""
from __future__ import annotations

import importlib.metadata
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import orchestrator
from helpers import ORCH, orch, orch_in_process
from orchestrator.cli import interrupt_on_termination

CONSOLE_SCRIPT = Path(sys.executable).parent / "orch"
SUBCOMMANDS = ("up", "stop", "logs", "status", "split-data")


def run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return orch_in_process(cwd, *args)


def run_process(cwd: Path, *args: str, entry: str = "module") -> subprocess.CompletedProcess:
    """A new process, through the console script or `python -m orchestrator`."""
    return orch(cwd, *args, timeout=60,
                command=ORCH if entry == "module" else [str(CONSOLE_SCRIPT)])


def test_help_lists_every_command(tmp_path: Path) -> None:
    result = run(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help(command: str, tmp_path: Path) -> None:
    result = run(tmp_path, command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: orch {command}"), result.stdout
    assert "-c FILE, --config FILE" in result.stdout


def test_unknown_command_is_a_usage_error(tmp_path: Path) -> None:
    result = run(tmp_path, "launch")
    assert result.returncode == 2
    assert "launch" in result.stderr and "Traceback" not in result.stderr


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    result = run(tmp_path)
    assert result.returncode == 2
    assert "usage: orch" in result.stderr and "Traceback" not in result.stderr


def test_unknown_option_is_a_usage_error(tmp_path: Path) -> None:
    result = run(tmp_path, "up", "--detatch")
    assert result.returncode == 2
    assert "--detatch" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [("up", "nothere.yaml"), ("stop", "nothere.yaml"),
                                  ("logs", "-c", "nothere.yaml")])
def test_missing_inventory_is_named(args: tuple[str, ...], tmp_path: Path) -> None:
    result = run(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    assert "nothere.yaml" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_default_inventory_is_cluster_yaml(tmp_path: Path) -> None:
    result = run(tmp_path, "status")
    assert result.returncode == 2, result.stderr
    assert "cluster.yaml" in result.stderr and "Traceback" not in result.stderr


def test_console_script_and_module_agree(tmp_path: Path) -> None:
    assert CONSOLE_SCRIPT.exists(), f"{CONSOLE_SCRIPT}: run `make install`"
    script = run_process(tmp_path, "--version", entry="script")
    module = run_process(tmp_path, "--version")
    assert script.returncode == module.returncode == 0, script.stderr + module.stderr
    assert script.stdout == module.stdout and script.stdout.startswith("orch ")
    # the version is written once (orchestrator/__init__.py); the package metadata reads it
    assert script.stdout.split() == ["orch", orchestrator.__version__]
    assert importlib.metadata.version("orch") == orchestrator.__version__
    helped = run_process(tmp_path, "--help", entry="script")
    assert helped.returncode == 0 and helped.stdout == run_process(tmp_path, "--help").stdout


def test_mistyped_command_suggests_the_right_one(tmp_path: Path) -> None:
    result = run(tmp_path, "stauts")
    assert result.returncode == 2
    assert "did you mean `status`?" in result.stderr


def test_unknown_option_shows_its_commands_usage(tmp_path: Path) -> None:
    result = run(tmp_path, "up", "--detatch")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: orch up"), result.stderr
    assert "did you mean `--detach`?" in result.stderr


def test_an_option_before_its_command_says_where_it_goes(tmp_path: Path) -> None:
    result = run(tmp_path, "--json", "status")
    assert result.returncode == 2
    assert "options go after the command: `orch status --json ...`" in result.stderr, result.stderr
    assert "did you mean" not in result.stderr


@pytest.mark.parametrize("ignored", [False, True], ids=["terminal", "nohup"])
def test_hangup_stops_the_job_unless_orch_was_started_with_nohup(ignored: bool) -> None:
    """SIGHUP (a closed terminal) is Ctrl-C for orch, unless it was ignored at start, as
    `nohup orch up` does: then orch outlives its terminal. (What cli() does first, here
    in this process, with the handlers put back after.)"""
    kept = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        interrupt_on_termination()
        hup, term = signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGTERM)
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    assert (hup == signal.SIG_IGN) == ignored and callable(hup) != ignored
    assert callable(term)


def test_a_command_that_reaches_no_host_imports_neither_ssh_nor_other_commands(
        tmp_path: Path) -> None:
    """paramiko (0.1 s) is imported by the commands that open a connection, and a command's
    module only when it is named: `--help` and a broken inventory start in a few ms. One
    new process runs `orch --help`, then `orch status` on a broken inventory."""
    probe = ("import sys\nfrom orchestrator import cli\n"
             "for argv in (['--help'], ['status']):\n"
             "    try:\n        code = cli.cli(argv)\n    except SystemExit as e:\n        code = e.code\n"
             "    mods = sorted(m for m in sys.modules if m.startswith(('paramiko', 'orchestrator.commands.')))\n"
             "    print('imported:', code, *mods)\n")
    (tmp_path / "cluster.yaml").write_text("name: x\nhosts: [\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert "split-data" in out.stdout and lines[-2] == "imported: 0", out.stdout + out.stderr
    assert lines[-1].split() == ["imported:", "2", "orchestrator.commands.common",
                                 "orchestrator.commands.status"], out.stdout + out.stderr


def test_up_imports_before_its_first_login_only_what_the_start_needs(tmp_path: Path) -> None:
    """`orch up` reaches its first login with the start's modules only: following the
    job, pulling, status, results and restarts (the api package resolves its names on
    first use) are imported once the job runs, while the hosts import torch."""
    probe = ("import sys\nfrom orchestrator import cli\n"
             "try:\n    code = cli.cli(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "later = ('orchestrator.watch.monitor', 'orchestrator.api.querying',\n"
             "         'orchestrator.api.pulling', 'orchestrator.api.executing',\n"
             "         'orchestrator.commands.restarting', 'orchestrator.commands.render',\n"
             "         'orchestrator.arrays.attach')\n"
             "print('imported:', code, 'orchestrator.api.launching' in sys.modules,\n"
             "      *sorted(m for m in later if m in sys.modules))\n")
    # an inventory that fails after the command's module is imported, before any login
    (tmp_path / "cluster.yaml").write_text("name: x\nhosts: [\n")
    out = subprocess.run([sys.executable, "-c", probe, "up"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["imported:", "2", "True"], out.stdout + out.stderr


def test_orch_ends_without_the_teardown_yet_flushes_and_runs_atexit(tmp_path: Path) -> None:
    """cli.main (the `orch` command): the command's exit code, its output flushed and the
    atexit handlers run, without the interpreter's teardown (an object only that frees
    is never freed)."""
    probe = ("import atexit, os, sys\nfrom orchestrator import cli, errors\n"
             "class Teardown:\n"
             "    def __del__(self, mk=os.open, close=os.close, path=sys.argv.pop(1)):\n"
             "        close(mk(path, os.O_CREAT | os.O_WRONLY))\n"
             "errors.kept = Teardown()\n"
             "atexit.register(lambda: sys.stdout.write('ATEXIT ran\\n'))\n"
             "sys.stdout.write('unflushed\\n')\n"
             "sys.argv[0] = 'orch'\ncli.main()\n")
    (tmp_path / "cluster.yaml").write_text("name: x\nhosts: [\n")
    teardown = tmp_path / "teardown"
    out = subprocess.run([sys.executable, "-c", probe, str(teardown), "status"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stdout.splitlines() == ["unflushed", "ATEXIT ran"], out.stdout
    assert "cluster.yaml" in out.stderr and not teardown.exists()
