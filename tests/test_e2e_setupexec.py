"""`setup:` and `orch exec` over real SSH (the fake sshd cluster).

Setup makes a venv on each host and pip-installs a wheel this test builds (no internet:
--no-index from a folder the fake hosts share with us); the job imports it with the
venv's python, which did not exist before setup. A second `up` skips setup, `--setup`
forces it, a failing host stops everything. exec: 3 hosts, a selection, a failing
host, --json, and Ctrl-C ending the command on every host.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import signal
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from helpers import Jobs, Running, assert_nothing_left, orch, part_dir, sessions_of, write_job
from sshd_cluster import FakeHost, SshdCluster, pids_with_env

pytestmark = pytest.mark.ssh
PY = sys.executable

JOB = """import os, sys
import tinypkg
print("tinypkg", tinypkg.VALUE, os.environ["RANK"], sys.executable, flush=True)
"""


def build_wheel(tmp_path: Path, value: str) -> Path:
    """tinypkg's wheel, written as the zip a wheel is (PEP 427): what `pip wheel` made
    of it, without the 2-3 s of CPU its build backend cost on a loaded machine."""
    files = {
        "tinypkg/__init__.py": f"VALUE = {value!r}\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: orch-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={_digest(text.encode())},{len(text.encode())}"
              for name, text in files.items()]
    files["tinypkg-1.0.dist-info/RECORD"] = "\n".join([*record, "tinypkg-1.0.dist-info/RECORD,,"]) + "\n"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "tinypkg-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return wheels


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def venv_inventory(
    cluster: SshdCluster, tmp_path: Path, hosts: list[FakeHost], name: str, setup: list[str]
) -> Path:
    """Each host's `python:` is the venv that setup makes in its job folder."""
    inv = cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=hosts, name=name, top={"setup": setup}
    )
    doc = yaml.safe_load(inv.read_text())
    for entry, h in zip(doc["hosts"], hosts):
        entry["python"] = str(h.remote_dir / name / "venv" / "bin" / "python")
    del doc["python"]
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inv


@pytest.mark.slow
def test_setup_makes_a_venv_once_and_the_job_uses_it(
    sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs
) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-setup"
    token = secrets.token_hex(4)
    wheels = build_wheel(tmp_path, f"wheel-{token}")
    site = sysconfig.get_paths()["purelib"]  # torch for the venv, without a download
    setup = [
        f"{PY} -m venv --without-pip ../venv",
        f'echo {site} > "$(echo ../venv/lib/python3*/site-packages)/orch-test-torch.pth"',
        # the venv's python runs pip (found through the .pth): `pip --python` ran a
        # second interpreter and pip's imports twice, 0.6 s of CPU more a host
        f"../venv/bin/python -m pip install -q --no-index --find-links {wheels} tinypkg",
    ]
    write_job(tmp_path, JOB)
    inv = venv_inventory(sshd_cluster, tmp_path, hosts, name, setup)
    jobs.add(inv, hosts, name)
    for h in hosts:
        assert not (h.remote_dir / name / "venv").exists()

    results = []
    counts = sessions_of(hosts, lambda: results.append(orch(tmp_path, "up", str(inv), timeout=240)))
    first = results[0]
    assert first.returncode == 0, first.stdout + first.stderr
    assert counts == {h.address: 1 for h in hosts}  # setup and the check ride the one agent
    assert "python" in first.stderr and "checked after setup" in first.stderr
    for h in hosts:
        venv_python = str(h.remote_dir / name / "venv" / "bin" / "python")
        assert f"[setup {h.address}] $ {PY} -m venv --without-pip ../venv" in first.stdout
        assert any(
            line.endswith(f"tinypkg wheel-{token} {r} {venv_python}")
            for r in range(2)
            for line in first.stdout.splitlines()
        ), first.stdout
        log = (h.remote_dir / name / "logs" / "setup.log").read_text()
        assert log.startswith(f"$ {PY} -m venv")
        assert json.loads((part_dir(h, name) / "setup.json").read_text())["fingerprint"]
    assert first.stdout.count(f"tinypkg wheel-{token}") == 2

    again = orch(tmp_path, "up", str(inv), timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "setup: skipped on 2 hosts" in again.stderr and "[setup " not in again.stdout
    assert again.stdout.count(f"tinypkg wheel-{token}") == 2  # the venv is still there

    forced = orch(tmp_path, "up", "--setup", str(inv), timeout=240)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "setup: done on 2 hosts" in forced.stderr
    assert forced.stdout.count("[setup ") >= 6
    assert_nothing_left(hosts, name)


def test_a_failing_setup_starts_nothing_anywhere(
    sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs
) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-setup-fail"
    write_job(tmp_path, "import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml",
        hosts=hosts,
        name=name,
        top={"setup": ["echo preparing", "if [ -e ../fail-here ]; then seq 1 30; exit 4; fi"]},
    )
    jobs.add(inv, hosts, name)
    bad = hosts[1]
    (bad.remote_dir / name).mkdir(parents=True, exist_ok=True)
    (bad.remote_dir / name / "fail-here").write_text("")
    try:
        result = orch(tmp_path, "up", str(inv), timeout=120)
    finally:
        (bad.remote_dir / name / "fail-here").unlink()
    assert result.returncode == 3, result.stdout + result.stderr
    err = result.stderr
    assert "1 of 2 hosts failed setup; nothing was started" in err
    assert f"{bad.address}: `if [ -e ../fail-here ]" in err and "exited with code 4" in err
    assert "| 30" in err and "| 21" in err and "| 20\n" not in err  # its last 10 lines
    assert f"{bad.remote_dir / name}/logs/setup.log" in err
    assert "started" not in result.stdout
    for h in hosts:
        assert not (part_dir(h, name) / "supervisor.json").exists()
    assert not (part_dir(bad, name) / "setup.json").exists()
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- exec


def exec_inventory(cluster: SshdCluster, tmp_path: Path, mark: str) -> Path:
    write_job(tmp_path, "print(1)\n")
    return cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=cluster.hosts[:3], name="e2e-exec", env={"EXEC_MARK": mark}
    )


def test_exec_on_all_hosts_a_selection_a_failure_and_json(
    sshd_cluster: SshdCluster, tmp_path: Path
) -> None:
    hosts = sshd_cluster.hosts[:3]
    mark = secrets.token_hex(4)
    inv = exec_inventory(sshd_cluster, tmp_path, mark)
    counts = {}

    def run_all() -> None:
        counts["r"] = orch(
            tmp_path,
            "exec",
            "-c",
            str(inv),
            "--",
            "sh",
            "-c",
            'echo "mark=$EXEC_MARK job=$ORCH_JOB"; echo "$1"',
            "sh",
            "it's ok; $HOME",
        )

    ones = sessions_of(hosts, run_all)
    r = counts["r"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert ones == {h.address: 1 for h in hosts}
    for h in hosts:
        assert f"[{h.address}] mark={mark} job=e2e-exec" in r.stdout
        assert f"[{h.address}] it's ok; $HOME" in r.stdout  # argv words, no shell on the way
        assert f"{h.address}: exit 0" in r.stderr

    some = orch(tmp_path, "exec", "-c", str(inv), "--hosts", f"{sshd_cluster.net}.[2-3]", "--",
                "true")
    assert some.returncode == 0, some.stderr
    assert [line.split(":")[0] for line in some.stderr.splitlines()] == [
        h.address for h in hosts[:2]
    ]

    bad = hosts[2]
    fail = orch(
        tmp_path,
        "exec",
        "-c",
        str(inv),
        "--",
        "sh",
        "-c",
        f'case "$ORCH_DATA_DIR" in {bad.remote_dir}/*) echo failing here; exit 5;; esac; echo fine',
    )
    assert fail.returncode == 1, fail.stdout + fail.stderr
    assert (
        f"{bad.address}: exit 5" in fail.stderr and f"[{bad.address}] failing here" in fail.stdout
    )
    assert f"{hosts[0].address}: exit 0" in fail.stderr

    doc_run = orch(
        tmp_path,
        "exec",
        "-c",
        str(inv),
        "--json",
        "--hosts",
        f"0,{bad.address}",
        "--",
        "sh",
        "-c",
        f'echo out-$EXEC_MARK; [ "$ORCH_DATA_DIR" != {bad.remote_dir}/e2e-exec/data ]',
    )
    assert doc_run.returncode == 1, doc_run.stderr
    doc = json.loads(doc_run.stdout)
    assert doc["exit_code"] == 1 and doc["interrupted"] is False
    assert doc["command"][:2] == ["sh", "-c"]
    assert [(row["host"], row["exit_code"], row["output"]) for row in doc["hosts"]] == [
        (hosts[0].address, 0, f"out-{mark}\n"),
        (bad.address, 1, f"out-{mark}\n"),
    ]

    usage = orch(tmp_path, "exec", "-c", str(inv), "--hosts", "9", "--", "true")
    assert usage.returncode == 2 and "no host 9" in usage.stderr
    assert orch(tmp_path, "exec", "-c", str(inv)).returncode == 2


def test_exec_ctrl_c_ends_the_command_on_every_host(
    sshd_cluster: SshdCluster, tmp_path: Path
) -> None:
    hosts = sshd_cluster.hosts[:3]
    mark = secrets.token_hex(4)
    inv = exec_inventory(sshd_cluster, tmp_path, mark)
    run = Running(
        tmp_path, "exec", "-c", str(inv), "--", "sh", "-c", "sleep 300 & echo started; wait"
    )
    try:
        run.wait_for(r"\] started$", count=3, timeout=60)
        assert len(pids_with_env(f"EXEC_MARK={mark}")) >= 6  # a shell and a sleep per host
        run.proc.send_signal(signal.SIGINT)
        assert run.proc.wait(30) == 130, run.text()
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    deadline = time.monotonic() + 10
    while pids_with_env(f"EXEC_MARK={mark}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids_with_env(f"EXEC_MARK={mark}") == []
    err = "\n".join(run.err)
    assert "interrupted: the command was ended on every host" in err
    for h in hosts:  # each host answered the cancel (not only the end of its input)
        assert f"{h.address}: signal 15" in err, err
