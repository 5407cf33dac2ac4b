"""`orch exec` and the inventory's `python:` (a venv's) over real SSH: `'$ORCH_PYTHON'`
runs it, ORCH_PYTHON is in the command's environment, and a `python3 ...` that fails
there hints at both."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import orch
from sshd_cluster import SshdCluster


@pytest.mark.ssh
def test_exec_reaches_the_inventorys_python(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = next(venv.glob("lib/python3*/site-packages"))
    (site / "onlyvenv.py").write_text("WHERE = 'the venv'\n")
    python = str(venv / "bin" / "python")
    hosts = sshd_cluster.hosts[:2]
    (tmp_path / "job.py").write_text("")
    sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name="e2e-py",
                                       top={"python": python})
    code = "import onlyvenv; print(onlyvenv.WHERE)"

    ok = orch(tmp_path, "exec", "--", "$ORCH_PYTHON", "-c", code)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert all(f"[{h.address}] the venv" in ok.stdout for h in hosts), ok.stdout
    env = orch(tmp_path, "exec", "--", "sh", "-c", 'echo "py=$ORCH_PYTHON"')
    assert env.returncode == 0 and env.stdout.count(f"py={python}") == 2, env.stdout

    path_python = orch(tmp_path, "exec", "--", "python3", "-c", code)
    assert path_python.returncode == 1, path_python.stdout + path_python.stderr
    assert "No module named 'onlyvenv'" in path_python.stdout, path_python.stdout
    assert f"the inventory's `python: {python}`" in path_python.stderr, path_python.stderr
    assert f"orch exec -- '$ORCH_PYTHON' -c '{code}'" in path_python.stderr, path_python.stderr
