"""Each rank's start (orchestrator/agent/rankexec.py), run as torchrun runs it under orch
(`python -u <job>/run/<part>/rankexec.py <job> script|module <target> [args]`): the user's
code sees what `python script.py` or `python -m module` would show it, its output lands in
its log, its heartbeat and stack files are there, and no link in the job folder is
followed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from helpers import wait_until
from orchestrator.agent import rankexec
from orchestrator.config.inventory import load
from orchestrator.session.launch import torchrun_argv

# what the user's code sees of itself: __main__'s names, argv, path[0], its file
SHOW = """\
import json, os, sys
print(json.dumps({"names": sorted(k for k in globals() if k not in ("json", "os", "sys")),
                  "argv": sys.argv, "path0": sys.path[0], "file": globals().get("__file__"),
                  "loader": type(__loader__).__name__, "name": __name__,
                  "spec": getattr(__spec__, "name", None),
                  "heartbeat": os.environ.get("ORCH_HEARTBEAT"),
                  "python": os.environ.get("ORCH_PYTHON"),
                  "stdin": sys.stdin.read()}))
"""


def job(tmp_path: Path, part: str = "") -> Path:
    folder = tmp_path / "job"
    for d in ("logs", "code", f"run/{part}" if part else "run"):
        (folder / d).mkdir(parents=True, exist_ok=True)
    return folder


def start(folder: Path, kind: str, target: str, *args: str, rank: int = 0, part: str = "",
          **env: str) -> subprocess.CompletedProcess[bytes]:
    """A rank as torchrun starts it: stdin and stdout of its own (not the log)."""
    env = dict(os.environ, RANK=str(rank), **({"ORCH_JOB_PART": part} if part else {}), **env)
    env.pop("ORCH_PYTHON", None)
    return subprocess.run([sys.executable, "-u", rankexec.__file__, str(folder), kind, target,
                           *args], cwd=folder / "code", env=env, input=b"not for the rank",
                          capture_output=True, timeout=60)


def same_view(got: dict, folder: Path, *argv: str) -> None:
    """What the rank's code saw of itself is what `python -u <argv>` shows in code/."""
    plain = subprocess.run([sys.executable, "-u", *argv], cwd=folder / "code",
                           capture_output=True, stdin=subprocess.DEVNULL, check=True)
    want = json.loads(plain.stdout)
    for key in ("names", "argv", "path0", "file", "loader", "name", "spec"):
        assert got[key] == want[key], (key, got[key], want[key])


def test_a_script_rank_sees_what_python_script_would_show_it(tmp_path: Path) -> None:
    folder = job(tmp_path, part="host-a")
    script = folder / "code" / "show.py"
    script.write_text(SHOW)
    res = start(folder, "script", "show.py", "--lr", "0.1", rank=3, part="host-a")
    assert res.returncode == 0 and res.stdout == b"" and res.stderr == b"", res
    got = json.loads((folder / "logs" / "rank-3.log").read_text())
    same_view(got, folder, "show.py", "--lr", "0.1")
    assert got["stdin"] == ""   # /dev/null, not what torchrun's stdin held
    assert got["heartbeat"] == str(folder / "run" / "host-a" / "heartbeat-3")
    assert (folder / "run" / "host-a" / "heartbeat-3").exists()
    assert got["python"] == sys.executable


def test_a_module_rank_runs_as_python_m_would(tmp_path: Path) -> None:
    folder = job(tmp_path)
    pkg = folder / "code" / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text(SHOW)
    res = start(folder, "module", "trainer.main", "x")
    assert res.returncode == 0, res
    same_view(json.loads((folder / "logs" / "rank-0.log").read_text()), folder,
              "-m", "trainer.main", "x")


def test_a_failing_rank_ends_with_its_own_code_and_traceback_in_its_log(tmp_path: Path) -> None:
    folder = job(tmp_path)
    (folder / "code" / "fail.py").write_text("import sys\nprint('before')\nraise SystemExit(7)\n")
    (folder / "code" / "boom.py").write_text("def f():\n    raise ValueError('boom')\nf()\n")
    assert start(folder, "script", "fail.py", rank=1).returncode == 7
    assert (folder / "logs" / "rank-1.log").read_text() == "before\n"
    assert start(folder, "script", "boom.py", rank=2).returncode == 1
    log = (folder / "logs" / "rank-2.log").read_text()
    assert "ValueError: boom" in log and 'boom.py", line 2, in f' in log, log


def test_the_stack_signal_writes_every_threads_stack(tmp_path: Path) -> None:
    folder = job(tmp_path)
    (folder / "code" / "wait.py").write_text(
        "import time\ndef waiting_here():\n    print('ready', flush=True)\n"
        "    time.sleep(60)\nwaiting_here()\n")
    env = dict(os.environ, RANK="0")
    proc = subprocess.Popen([sys.executable, "-u", rankexec.__file__, str(folder), "script",
                             "wait.py"], cwd=folder / "code", env=env)
    try:
        log = folder / "logs" / "rank-0.log"
        wait_until(lambda: log.exists() and log.read_text() == "ready\n", 30, "the rank ready")
        os.kill(proc.pid, rankexec.STACK_SIGNAL)
        stack = folder / "run" / "stack-0"
        wait_until(lambda: "in waiting_here" in stack.read_text(), 30, "the rank's stack")
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL   # the dump did not end it


def test_a_link_at_the_log_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    folder = job(tmp_path)
    (folder / "code" / "hi.py").write_text("print('hi')\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / "logs" / "rank-0.log").symlink_to(victim)
    res = start(folder, "script", "hi.py")
    assert res.returncode == 1 and b"Too many levels of symbolic links" in res.stderr, res
    assert victim.read_text() == "precious\n"


def test_torchrun_starts_each_rank_on_its_start_with_python_exec_kept(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: demo\nhosts:\n  - address: h0\n    procs: 2\n"
                    "job:\n  entrypoint: train.py\n  args: [--lr, '0.1']\n"
                    "  env:\n    PYTHON_EXEC: /opt/py/bin/python3\n")
    cluster = load(path)
    argv = torchrun_argv(cluster, cluster.hosts[0], "python3", "/r/demo", "10.0.0.1", 29500)
    at = argv.index("--no-python")
    assert argv[at + 1:] == ["/opt/py/bin/python3", "-u", "/r/demo/run/host-h0/rankexec.py",
                             "/r/demo", "script", "train.py", "--lr", "0.1"], argv
