"""Hostile inputs over real SSH (issue 23, item 3): what a value can hold reaches the
rank byte for byte, and what a file system allows in a name round-trips.

- job.args items and job.env values with line breaks, a carriage return, an escape, a
  tab, non-ASCII text and a PEM key: the rank gets exactly those (written as JSON there);
- shard files whose names hold any byte POSIX allows (a backslash, a line break, a tab,
  an escape, a byte that is not UTF-8, quotes, a leading space or dash, a glob character,
  decomposed Unicode, 255 bytes) reach their rank under those names, byte for byte, and
  files of output/ named so come back with `orch pull`."""
from __future__ import annotations

import json
import os
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
bdata = os.fsencode(data)
seen = {"args": sys.argv[1:], "env": [os.environ["V%d" % i] for i in range(%d)],
        "data": sorted(os.path.relpath(os.path.join(d, f), bdata).hex()
                       for d, _, fs in os.walk(bdata) for f in fs)}
with open(os.path.join(out, "seen-%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
for name in NAMES:
    with open(os.path.join(os.fsencode(out), bytes.fromhex(name)), "w") as f:
        f.write("kept")
""".replace("%d)", f"{len(VALUES)})")
# names any POSIX file system takes (every byte but "/" and NUL), as bytes
NAMES = [b"back\\slash", b"line\nbreak", b"tab\there", b"\x1b[31mred", b"not-utf8-\xff\xfe",
         b"q'uote\"s", b" leading space", b"-leading-dash", b"*star?[x]", b"e\xcc\x81-nfd",
         b"x" * 251 + b".jpg"]
JOB = JOB.replace("NAMES:", repr([n.hex() for n in NAMES]) + ":")


def image(name: bytes) -> bytes:
    """The name as split-data takes it: an image's extension."""
    return name if name.endswith(b".jpg") else name + b".jpg"


def test_args_env_and_names_reach_the_rank_exactly(sshd_cluster: SshdCluster, tmp_path: Path,
                                                   jobs: Jobs) -> None:
    host = sshd_cluster.hosts[0]
    write_job(tmp_path, JOB)
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    (src / "plain.jpg").write_bytes(b"a")
    for name in NAMES:
        Path(os.fsdecode(os.path.join(os.fsencode(src), image(name)))).write_bytes(name)
    lib = os.path.join(os.fsencode(tmp_path), b"lib")
    os.mkdir(lib)
    for name in NAMES:   # code/ too: pushed once, under its own name
        with open(os.path.join(lib, name), "wb") as f:
            f.write(name)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[host], name="hostile", args=VALUES,
        code_paths=("job.py", "lib"),
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
    assert sorted(bytes.fromhex(h) for h in seen["data"]) == sorted(
        [b"cls/plain.jpg"] + [b"cls/" + image(n) for n in NAMES])
    code = os.fsencode(host.remote_dir / "hostile" / "code" / "lib")
    assert sorted(os.listdir(code)) == sorted(NAMES)
    for name in NAMES:
        with open(os.path.join(code, name), "rb") as f:
            assert f.read() == name
    pulled = os.fsencode(tmp_path / "outputs" / "hostile")
    for name in NAMES:
        with open(os.path.join(pulled, name)) as f:
            assert f.read() == "kept", sorted(os.listdir(pulled))
    assert_nothing_left([host], "hostile")
