"""Hostile inputs over real SSH (issue 23, item 3): what a value can hold reaches the
rank byte for byte, and what a file system allows in a name round-trips.

- job.args items and job.env values with line breaks, a carriage return, an escape, a
  tab, non-ASCII text and a PEM key: the rank gets exactly those (written as JSON there);
- a shard file whose name holds a backslash reaches its rank under that name, and a file
  of output/ named so comes back with `orch pull`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, orch, write_job
from sshd_cluster import SshdCluster

pytestmark = pytest.mark.ssh

VALUES = ["line one\nline two", "carriage\rreturn", "\x1b[31mred\x1b[0m", "tab\there",
          "ünïcødé ✓", "-----BEGIN PRIVATE KEY-----\nMIIEv\n-----END PRIVATE KEY-----\n",
          "  spaces  ", "'quotes\" and $HOME `x` \\ back"]
JOB = """\
import json, os, sys
out = os.environ["ORCH_OUTPUT_DIR"]
os.makedirs(out, exist_ok=True)
data = os.path.join(os.environ["ORCH_DATA_DIR"], "worker_%s_of_%s" % (os.environ["RANK"],
                    os.environ["WORLD_SIZE"]))
seen = {"args": sys.argv[1:], "env": [os.environ["V%d" % i] for i in range(%d)],
        "data": sorted(os.path.relpath(os.path.join(d, f), data)
                       for d, _, fs in os.walk(data) for f in fs)}
with open(os.path.join(out, "seen-%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
with open(os.path.join(out, "back\\\\slash.txt"), "w") as f:
    f.write("kept")
""".replace("%d)", f"{len(VALUES)})")


def test_args_env_and_names_reach_the_rank_exactly(sshd_cluster: SshdCluster, tmp_path: Path,
                                                   jobs: Jobs) -> None:
    host = sshd_cluster.hosts[0]
    write_job(tmp_path, JOB)
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    (src / "plain.jpg").write_bytes(b"a")
    (src / "back\\slash.jpg").write_bytes(b"b")
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[host], name="hostile", args=VALUES,
        env={f"V{i}": v for i, v in enumerate(VALUES)},
        top={"data": {"source": "src", "shards": "shards"}})
    jobs.add(inv, [host], "hostile")
    split = orch(tmp_path, "split-data", "-c", str(inv), "--workers", "1")
    assert split.returncode == 0, split.stdout + split.stderr
    dry = orch(tmp_path, "up", str(inv), "--dry-run")
    assert dry.returncode == 0 and "\x1b" not in dry.stdout and "\\x1b[31m" in dry.stdout
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    seen = json.loads((host.remote_dir / "hostile" / "output" / "seen-0.json").read_text())
    assert seen["args"] == VALUES and seen["env"] == VALUES
    assert seen["data"] == ["cls/back\\slash.jpg", "cls/plain.jpg"]
    pulled = tmp_path / "outputs" / "hostile"
    assert (pulled / "back\\slash.txt").read_text() == "kept", sorted(pulled.rglob("*"))
    assert_nothing_left([host], "hostile")
