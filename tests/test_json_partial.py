"""`--json` is one JSON document on stdout (the SPEC), also when `orch stop` or `orch pull`
fail part way: what was done, with the error's `error` and `exit_code` added."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import orch_in_process
from orchestrator.api import pulling, stopping
from orchestrator.api.outcomes import PullResult, StopResult
from orchestrator.errors import HostError

INVENTORY = "name: t\nhosts:\n  - address: localhost\n    connection: local\njob:\n  entrypoint: w.py\n"


def failing(result: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        error = HostError("10.0.0.9: not reached", hint="run `orch stop` again")
        error.result = result
        raise error
    return call


@pytest.mark.parametrize("command", ["stop", "pull"])
def test_a_partial_failure_is_one_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           command: str) -> None:
    (tmp_path / "cluster.yaml").write_text(INVENTORY)
    if command == "stop":
        monkeypatch.setattr(stopping, "stop", failing(StopResult("t", {}, {"10.0.0.9": "lost"})))
    else:
        monkeypatch.setattr(pulling, "pull", failing(PullResult(
            "10.0.0.8", "output", "outputs/t", 1, 10, 0, 1, [], 0, [{"p": "a", "why": "x"}])))
    r = orch_in_process(tmp_path, command, "--json")
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)   # one document: a second would make this fail
    assert doc["version"] == 1 and doc["exit_code"] == 3 and "not reached" in doc["error"]
    assert "orch: 10.0.0.9: not reached" in r.stderr
