"""bench/scale.py's stand-in torchrun keeps torchrun's contract: arguments, the ranks'
environment, a rendezvous of all nodes at the master, the worst exit code."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from sshd_cluster import free_port

STANDIN = Path(__file__).resolve().parent.parent / "bench" / "torchrun_standin.py"
JOB = """\
import os, sys
keys = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT".split()
# one write: the ranks share the stream, and a line must not be cut by another
line = " ".join(k + "=" + os.environ[k] for k in keys) + " " + str(sys.argv[1:])
sys.stdout.write(line + "\\n")
sys.stdout.flush()
sys.exit(int(os.environ["RANK"]) == int(os.environ.get("FAIL_RANK", "-1")) and 3)
"""


def standin(tmp: Path, node: int, port: int, *, env: dict | None = None) -> subprocess.CompletedProcess:
    (tmp / "job.py").write_text(JOB)
    argv = [sys.executable, str(STANDIN), "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--max-restarts", "0", "--log-dir", str(tmp / "logs"), "job.py", "--lr", "1"]
    return subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=60,
                          env=env)


def test_two_nodes_meet_and_get_torchrun_env(tmp_path: Path) -> None:
    port = free_port(["127.0.0.1"], 29600, 29900)
    out: dict = {}
    peer = threading.Thread(target=lambda: out.setdefault(1, standin(tmp_path, 1, port)))
    peer.start()
    zero = standin(tmp_path, 0, port)
    peer.join(60)
    assert zero.returncode == 0 and out[1].returncode == 0, (zero.stderr, out[1].stderr)
    lines = sorted((zero.stdout + out[1].stdout).splitlines())
    assert len(lines) == 4
    assert lines[3] == (f"RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 "
                        f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} ['--lr', '1']")


def test_worst_exit_code(tmp_path: Path) -> None:
    import os
    env = dict(os.environ, FAIL_RANK="1")
    (tmp_path / "job.py").write_text(JOB)
    argv = [sys.executable, str(STANDIN), "--nproc-per-node", "2", "job.py"]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 3
