"""`orch exec` reaches the inventory's `python:`: ORCH_PYTHON in every exec's (and
setup's) environment, `'$ORCH_PYTHON'` as the command's first word, and a failed
`python3 ...` hints at them when `python:` names another interpreter."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.agent import shellcmd
from orchestrator.api.outcomes import ExecResult, HostExec
from orchestrator.commands.exec import python_hint
from orchestrator.config.inventory import Cluster, parse
from test_setupexec import Req


def test_exec_has_orch_python_and_its_first_word(tmp_path: Path) -> None:
    req = Req("exec", job_dir=str(tmp_path), env={},
              argv=["$ORCH_PYTHON", "-c", "import os, sys; print(sys.executable); "
                    "print(os.environ['ORCH_PYTHON'])"])
    assert shellcmd.run_exec(req)["code"] == 0
    assert req.output().decode().splitlines() == [sys.executable, sys.executable]
    braces = Req("exec", job_dir=str(tmp_path), env={}, argv=["${ORCH_PYTHON}", "-c", "pass"])
    assert shellcmd.run_exec(braces)["code"] == 0


def test_orch_python_is_the_missing_path_when_setup_makes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_PYTHON_MISSING", "~/venv/bin/python")
    assert shellcmd.interpreter() == str(Path("~/venv/bin/python").expanduser())
    req = Req("exec", job_dir=str(tmp_path), env={}, argv=["$ORCH_PYTHON", "-c", "pass"])
    assert shellcmd.run_exec(req)["code"] == 127   # as a shell says: not there (yet)


def inventory(tmp_path: Path, python: str) -> Cluster:
    text = f"name: t\npython: {python}\nhosts:\n  - address: 10.0.0.8\n  - address: 10.0.0.9\n"
    text += "job:\n  entrypoint: train.py\n"
    return parse(text, tmp_path / "cluster.yaml")


def result(argv: list[str], codes: list[int | None]) -> ExecResult:
    hosts = [HostExec(host=f"10.0.0.{8 + i}", index=i, exit_code=c, output="",
                      output_truncated=False, error=None) for i, c in enumerate(codes)]
    return ExecResult(command=argv, hosts=hosts, interrupted=False, exit_code=1, failures={})


def test_a_failed_path_python_hints_at_the_inventorys(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)   # ./cluster.yaml: the hint needs no -c
    cluster = inventory(tmp_path, "/opt/venv/bin/python")
    argv = ["python3", "-c", "import torch; print(torch.__version__)"]
    hint = python_hint(cluster, result(argv, [1, 0]))
    assert "`python: /opt/venv/bin/python`" in hint, hint
    assert "`orch exec -- '$ORCH_PYTHON' -c 'import torch; print(torch.__version__)'`" in hint
    assert python_hint(cluster, result(argv, [0, 0])) == ""
    assert python_hint(cluster, result(["nvidia-smi"], [1, 1])) == ""
    same = inventory(tmp_path, "python3")
    assert python_hint(same, result(argv, [1, 1])) == ""
