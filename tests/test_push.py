"""Pushing data shards at `orch up` (orchestrator/files/sync.py, shards.py, agent.py receive).

End to end over real SSH (the fake sshd cluster): each host gets exactly its ranks'
shards as real files, byte for byte; a second push sends nothing; a push killed half way
resumes with only what is missing; a file corrupted on the host is sent again; a split
for the wrong world size and unsafe manifests are refused before anything lands. The
agent's own guards (crafted receive streams) are tested without SSH.

Jobs are plain Python (no torch import): each rank hashes its own shard through
$ORCH_DATA_DIR and prints the result, which proves where ORCH_DATA_DIR points.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import (
    ORCH,
    agents_of,
    assert_nothing_left,
    file_sha,
    job_dir,
    last_sync,
    orch,
    wait_until,
)
from orchestrator.files import splitdata
from orchestrator.remote import bundle
from orchestrator.wire import protocol
from sshd_cluster import FakeHost, SshdCluster

# host 0: ranks 0 and 1, host 1: rank 2. Two hosts prove the placement: a host of two
# ranks holds both their shards and no other, and the host after it starts at the next
# rank (a third host would start one more torchrun per `orch up`, ~3 s of CPU each)
PROCS = [2, 1]
WORLD = sum(PROCS)

# Each rank hashes every file of its own shard, read through $ORCH_DATA_DIR.
DATA_JOB = """\
import hashlib, json, os
data, rank, world = os.environ["ORCH_DATA_DIR"], os.environ["RANK"], os.environ["WORLD_SIZE"]
mine = os.path.join(data, "worker_%s_of_%s" % (rank, world))
files = {}
for top, dirs, names in os.walk(mine):
    for n in names:
        p = os.path.join(top, n)
        with open(p, "rb") as f:
            files[os.path.relpath(p, mine)] = hashlib.sha256(f.read()).hexdigest()
print("DATA " + json.dumps({"rank": int(rank), "dir": data, "files": files}), flush=True)
"""


# ---------------------------------------------------------------- helpers

def tree(root: Path) -> dict[str, tuple[str, str | None]]:
    """Every entry under root: rel -> (kind, sha256 of a regular file). Links are
    reported as links, never followed: the host must hold real files."""
    out: dict[str, tuple[str, str | None]] = {}
    for top, dirs, names in os.walk(root):
        for n in dirs + names:
            p = Path(top, n)
            rel = str(p.relative_to(root))
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = ("link", None)
            elif stat.S_ISREG(mode):
                out[rel] = ("file", file_sha(p))
            elif stat.S_ISDIR(mode):
                out[rel] = ("dir", None)
            else:
                out[rel] = ("other", None)
    return out


def remote_data(host: FakeHost, name: str) -> dict[str, str]:
    """The files of the host's data/ folder (rel -> sha256); anything that is not a
    plain file or folder fails the test."""
    entries = tree(job_dir(host, name) / "data")
    odd = {rel: kind for rel, (kind, _) in entries.items() if kind not in ("file", "dir")}
    assert not odd, f"{host.address}: data/ holds links or special files: {odd}"
    return {rel: digest for rel, (kind, digest) in entries.items() if kind == "file" and digest}


@dataclass
class Dataset:
    """A source folder, its split and the expected content of every shard."""

    base: Path          # the inventory's folder
    source: Path
    shards: Path
    expected: dict[int, dict[str, str]]   # rank -> {path in its shard: sha256}

    def host_files(self, ranks: Sequence[int], world: int) -> dict[str, str]:
        return {f"worker_{r}_of_{world}/{rel}": digest
                for r in ranks for rel, digest in self.expected[r].items()}


def make_imagefolder(root: Path, classes: int, per_class: int, seed: int) -> None:
    """Class folders of random 1-8 KiB files, one nested folder, and one link inside the
    source (the push must send its target's bytes, not a link)."""
    rng = random.Random(seed)
    for c in range(classes):
        for i in range(per_class):
            sub = "nested/" if i % 5 == 4 else ""
            p = root / f"class{c}" / f"{sub}img_{i:03d}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(rng.randbytes(rng.randint(1024, 8192)))
    (root / "class0" / "alias.bin").symlink_to(root / "class1" / "img_000.bin")


def make_records(root: Path, count: int, size: int) -> None:
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"train-{i:05d}-of-{count:05d}").write_bytes(os.urandom(size))


def split(base: Path, source: Path, workers: int) -> Dataset:
    shards = base / "shards"
    splitdata.split(source, shards, workers)
    manifest = json.loads((shards / "manifest.json").read_text())
    expected = {}
    for rank, shard in enumerate(manifest["splits"][str(workers)]["shards"]):
        assert shard["name"] == f"worker_{rank}_of_{workers}"
        expected[rank] = {rel: file_sha(source / rel) for rel, _size in shard["files"]}
    return Dataset(base, source, shards, expected)


def inventory(cluster: SshdCluster, data: Dataset, hosts: Sequence[FakeHost],
              procs: list[int], name: str) -> Path:
    (data.base / "job.py").write_text(DATA_JOB)
    return cluster.write_inventory(
        data.base / "cluster.yaml", hosts=list(hosts), procs=procs, name=name,
        entrypoint="job.py", code_paths=["job.py"],
        top={"data": {"source": str(data.source), "shards": str(data.shards)}})


def ranks_of(procs: Sequence[int]) -> list[list[int]]:
    out, first = [], 0
    for n in procs:
        out.append(list(range(first, first + n)))
        first += n
    return out


def check_hosts(data: Dataset, hosts: Sequence[FakeHost], procs: Sequence[int],
                name: str) -> None:
    """Each host holds exactly its ranks' shards, byte-identical, as real files."""
    world = sum(procs)
    for host, ranks in zip(hosts, ranks_of(procs)):
        want = data.host_files(ranks, world)
        got = remote_data(host, name)
        assert sorted(got) == sorted(want), (
            f"{host.address} (ranks {ranks}): missing {sorted(set(want) - set(got))[:5]}, "
            f"unexpected {sorted(set(got) - set(want))[:5]}")
        wrong = [rel for rel in want if got[rel] != want[rel]]
        assert not wrong, f"{host.address}: content differs from the source: {wrong[:5]}"
        tops = set(os.listdir(job_dir(host, name) / "data"))
        assert tops == {f"worker_{r}_of_{world}" for r in ranks}, f"{host.address}: {tops}"


def check_job_output(stdout: str, data: Dataset, hosts: Sequence[FakeHost], name: str) -> None:
    """Every rank found its own shard, byte for byte, at $ORCH_DATA_DIR/worker_<r>_of_<W>."""
    seen = {}
    for line in stdout.splitlines():
        if "] DATA " in line:
            info = json.loads(line.split("] DATA ", 1)[1])
            seen[info["rank"]] = info
    assert sorted(seen) == list(range(WORLD)), stdout[-2000:]
    for host, ranks in zip(hosts, ranks_of(PROCS)):
        for r in ranks:
            assert seen[r]["dir"] == str(job_dir(host, name) / "data")
            assert seen[r]["files"] == data.expected[r], f"rank {r} read other bytes"


# ---------------------------------------------------------------- two hosts, world size 3

@dataclass
class Pushed:
    data: Dataset
    hosts: list[FakeHost]
    name: str
    inventory: Path


@pytest.fixture(scope="module")
def pushed(sshd_cluster: SshdCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    """A small ImageFolder split 3 ways, pushed once by `orch up` to 2 hosts (procs 2, 1)."""
    base = tmp_path_factory.mktemp("push")
    make_imagefolder(base / "src", classes=4, per_class=14, seed=1)
    data = split(base, base / "src", WORLD)
    hosts, name = sshd_cluster.hosts[:2], "push-two"
    inv = inventory(sshd_cluster, data, hosts, PROCS, name)
    first = orch(base, "up", str(inv))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    check_job_output(first.stdout, data, hosts, name)
    report = last_sync(base, name)
    for host, ranks in zip(hosts, ranks_of(PROCS)):
        assert sorted(report[host.address]["data"]["sent"]) == sorted(data.host_files(ranks, WORLD))
    assert_nothing_left(hosts, name, wait=10, kill=True)
    yield Pushed(data, hosts, name, inv)
    assert_nothing_left(hosts, name, wait=10, kill=True)


def test_each_host_holds_exactly_its_shards(pushed: Pushed) -> None:
    check_hosts(pushed.data, pushed.hosts, PROCS, pushed.name)
    for host in pushed.hosts:
        parts = list((job_dir(host, pushed.name) / "data").rglob("*.orch-part-*"))
        assert not parts, f"{host.address}: {parts}"


def test_second_up_sends_no_data(pushed: Pushed) -> None:
    again = orch(pushed.data.base, "up", str(pushed.inventory))
    assert again.returncode == 0, again.stderr
    report = last_sync(pushed.data.base, pushed.name)
    for host in pushed.hosts:
        data = report[host.address]["data"]
        assert data == {"files": 0, "bytes": 0, "deleted": 0, "sent": []}, (host.address, data)
    check_hosts(pushed.data, pushed.hosts, PROCS, pushed.name)
    assert_nothing_left(pushed.hosts, pushed.name, wait=10, kill=True)


def test_file_changed_on_host_is_sent_again(pushed: Pushed) -> None:
    """Same size, new bytes, new mtime: the host's digest cache must not hide it. A file
    orch did not push (the job's, a setup step's) stays where it is."""
    host, shard = pushed.hosts[0], f"worker_1_of_{WORLD}"   # the host of two ranks
    victim_rel = sorted(pushed.data.expected[1])[0]
    victim = job_dir(host, pushed.name) / "data" / shard / victim_rel
    size = victim.stat().st_size
    victim.write_bytes(b"\0" * size)
    later = time.time() + 5
    os.utime(victim, (later, later))
    stray = job_dir(host, pushed.name) / "data" / "notes-from-setup.txt"
    stray.write_bytes(b"not part of the split")

    again = orch(pushed.data.base, "up", str(pushed.inventory))
    assert again.returncode == 0, again.stderr
    report = last_sync(pushed.data.base, pushed.name)
    assert report[host.address]["data"]["sent"] == [f"{shard}/{victim_rel}"]
    assert report[host.address]["data"]["deleted"] == 0
    assert report[pushed.hosts[1].address]["data"]["files"] == 0
    assert file_sha(victim) == pushed.data.expected[1][victim_rel]
    assert stray.read_bytes() == b"not part of the split"
    stray.unlink()
    check_hosts(pushed.data, pushed.hosts, PROCS, pushed.name)
    check_job_output(again.stdout, pushed.data, pushed.hosts, pushed.name)
    assert_nothing_left(pushed.hosts, pushed.name, wait=10, kill=True)


# ---------------------------------------------------------------- interrupted push

def count_data_files(hosts: Sequence[FakeHost], name: str, size: int) -> int:
    """Shard files that are complete on the hosts, in place or in a staging folder. A
    staged file is written under its final name, so one still being written is not
    counted (an interrupt then could still find nothing complete)."""
    total = 0
    for h in hosts:
        for top, _dirs, names in os.walk(job_dir(h, name) / "data"):
            total += sum(1 for n in names if n.startswith("train-") and ".orch-part-" not in n
                         and file_size(Path(top) / n) == size)
    return total


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


@pytest.mark.slow  # runs `orch up` (without the `pushed` fixture)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_interrupted_push_resends_only_what_is_missing(
        sshd_cluster: SshdCluster, tmp_path: Path, sig: signal.Signals) -> None:
    """Kill `orch up` once a few shard files have landed; the next `orch up` sends only
    the rest and the hosts end up exactly as after an uninterrupted push."""
    hosts, procs = sshd_cluster.hosts[2:4], [1, 1]
    name = f"push-resume-{sig.name.lower()}"
    count, size = 32, 1 << 20
    make_records(tmp_path / "src", count, size)
    data = split(tmp_path, tmp_path / "src", 2)
    inv = inventory(sshd_cluster, data, hosts, procs, name)

    proc = subprocess.Popen(ORCH + ["up", str(inv)], cwd=tmp_path, env=dict(os.environ),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_until(lambda: count_data_files(hosts, name, size) >= 2 or proc.poll() is not None,
                   60, "the first shard files on the hosts", step=0.005)
        # the hosts frozen at once (their sshd and receivers SIGSTOPped): nothing more
        # lands until orch has its signal, so the push cannot finish between seeing the
        # files and the signal, however loaded the machine
        for h in hosts:
            h.pause()
        try:
            assert proc.poll() is None, "the push ended before the signal"
            proc.send_signal(sig)
            t0 = time.monotonic()
            _out, err = proc.communicate(timeout=30)
            stopped_s = time.monotonic() - t0
        finally:
            for h in hosts:
                h.resume()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err.decode()[-2000:]
        assert "Traceback" not in err.decode(), err.decode()[-2000:]
        assert stopped_s < 10, f"Ctrl-C took {stopped_s:.1f} s to stop the push"
    for h in hosts:
        dest = job_dir(h, name) / "data"
        # wait_until calls the lambda before the next iteration: the late binding is harmless
        wait_until(lambda: not agents_of([dest.parent]), 10, f"the receiver on {h.address} to end")  # noqa: B023
    assert_nothing_left(hosts, name, wait=10, kill=True)
    missing = {h.address: sorted(set(data.host_files(r, 2).items()) - set(remote_data(h, name).items()))
               for h, r in zip(hosts, ranks_of(procs))}
    missed = sum(map(len, missing.values()))
    assert missed, (f"{sig.name} {stopped_s:.1f} s before orch ended did not stop the push: "
                    f"all {count} files were sent anyway")
    assert missed < count, "nothing had landed when the push was interrupted"

    again = orch(tmp_path, "up", str(inv))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    report = last_sync(tmp_path, name)
    for h in hosts:
        sent = report[h.address]["data"]["sent"]
        assert sorted(sent) == [rel for rel, _ in missing[h.address]], (h.address, sent)
    check_hosts(data, hosts, procs, name)
    for h in hosts:
        parts = list((job_dir(h, name) / "data").rglob("*.orch-part-*"))
        assert not parts, f"{h.address}: half-written files left beside the shards: {parts}"
    assert_nothing_left(hosts, name, wait=10, kill=True)


# ---------------------------------------------------------------- refusals

def _drop_last_shard(shards: Path) -> None:
    """A manifest whose split for 4 workers lists only 3 shards (edited, or half-written)."""
    path = shards / "manifest.json"
    manifest = json.loads(path.read_text())
    split_3 = manifest["splits"].pop("3")
    split_3["shards"] = split_3["shards"][:3]
    manifest["splits"]["4"] = split_3
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["split-for-3", "4-with-3-shards"])
def test_wrong_world_size_is_refused_before_any_host_is_touched(
        sshd_cluster: SshdCluster, tmp_path: Path, how: str) -> None:
    make_imagefolder(tmp_path / "src", classes=2, per_class=6, seed=2)
    data = split(tmp_path, tmp_path / "src", 3)
    if how == "4-with-3-shards":
        _drop_last_shard(data.shards)
    hosts, name = sshd_cluster.hosts[:3], f"push-wrong-world-{how}"
    inv = inventory(sshd_cluster, data, hosts, [1, 2, 1], name)   # world size 4
    res = orch(tmp_path, "up", str(inv))
    assert res.returncode == 2, res.stderr
    assert "orch split-data --workers 4" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    for h in hosts:
        assert not job_dir(h, name).exists(), f"{h.address}: the job folder was created"
    assert_nothing_left(hosts, name, wait=10, kill=True)


def _dotdot(data: Dataset, shard: dict) -> str:
    """A path that climbs out of the shard and of data/ but resolves into the source."""
    return "../../src/" + shard["files"][0][0]


def _absolute(data: Dataset, shard: dict) -> str:
    return str(data.source / shard["files"][0][0])


UNSAFE_PATHS = {"dotdot": _dotdot, "absolute": _absolute}


def _edit_manifest(data: Dataset, workers: int, make_rel: Callable[[Dataset, dict], str]) -> str:
    path = data.shards / "manifest.json"
    manifest = json.loads(path.read_text())
    shard = manifest["splits"][str(workers)]["shards"][0]
    rel = make_rel(data, shard)
    shard["files"].append([rel, 1])
    path.write_text(json.dumps(manifest))
    return rel


def _refused_and_nothing_written(sshd_cluster: SshdCluster, data: Dataset, name: str,
                                 words: Sequence[str]) -> None:
    hosts = sshd_cluster.hosts[3:4]
    inv = inventory(sshd_cluster, data, hosts, [2], name)
    res = orch(data.base, "up", str(inv))
    assert res.returncode == 2, res.stdout[-1000:] + res.stderr
    assert "Traceback" not in res.stderr
    for word in words:
        assert word in res.stderr, res.stderr
    jd = job_dir(hosts[0], name)
    written = [str(p) for p in jd.rglob("*") if not p.is_dir()] if jd.exists() else []
    assert written == [], f"files written on the host: {written}"
    assert_nothing_left(hosts, name, wait=10, kill=True)


@pytest.mark.parametrize("kind", sorted(UNSAFE_PATHS))
def test_unsafe_manifest_path_is_refused(sshd_cluster: SshdCluster, tmp_path: Path,
                                         kind: str) -> None:
    make_imagefolder(tmp_path / "src", classes=2, per_class=4, seed=3)
    data = split(tmp_path, tmp_path / "src", 2)
    rel = _edit_manifest(data, 2, UNSAFE_PATHS[kind])
    _refused_and_nothing_written(sshd_cluster, data, f"push-unsafe-{kind}", ["unsafe", rel])


def test_shard_link_leaving_the_source_is_refused(sshd_cluster: SshdCluster,
                                                  tmp_path: Path) -> None:
    make_imagefolder(tmp_path / "src", classes=2, per_class=4, seed=4)
    data = split(tmp_path, tmp_path / "src", 2)
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not part of the dataset\n")
    link = data.shards / "worker_0_of_2" / sorted(data.expected[0])[0]
    link.unlink()
    link.symlink_to(secret)
    _refused_and_nothing_written(sshd_cluster, data, "push-unsafe-link",
                                 ["outside", str(link)])


# ---------------------------------------------------------------- the agent's own guards

def test_receive_refuses_a_stream_through_a_link(tmp_path: Path) -> None:
    """A shard folder on the host that is a link (planted, or left by hand) is refused:
    nothing lands where it points."""
    root = tmp_path / "job" / "data"
    (root / "w0").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "w0" / "escape").symlink_to(tmp_path / "elsewhere")
    for rel in ("w0/escape/x.bin", "w0/escape/deeper/x.bin"):
        res = receive(root, frame(rel, b"x") + end())
        assert res.returncode != 0 and b"is a symbolic link" in res.stdout, res.stdout + res.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_receive_into_a_root_reached_through_a_link(tmp_path: Path) -> None:
    """remote_dir under a symlinked folder (/home -> /data/home, /tmp -> /private/tmp)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "home").symlink_to(real)
    res = receive(tmp_path / "home" / "job" / "data",
                  frame("worker_0_of_1/x.bin", b"x" * 10) + end())
    assert res.returncode == 0, res.stdout + res.stderr
    assert (real / "job" / "data" / "worker_0_of_1" / "x.bin").read_bytes() == b"x" * 10


def frame(rel: str, payload: bytes, digest: str | None = None) -> bytes:
    head = protocol.stream_item("file", p=rel, s=len(payload), m=0o644,
                                h=digest or hashlib.sha256(payload).hexdigest())
    return head + (protocol.frame(protocol.DATA, payload) if payload else b"")


def end(delete: Sequence[str] = ()) -> bytes:
    return protocol.stream_item("end", delete=list(delete))


def receive(root: Path, stream: bytes) -> subprocess.CompletedProcess:
    """The agent's `receive`, started as the controller starts it, without SSH: exit 0
    and the reply when it succeeded, else 1 and the error's message."""
    proc = subprocess.run(bundle.agent_argv(sys.executable), capture_output=True, timeout=30,
                          input=bundle.agent_stdin() + protocol.request("receive", 1, root=str(root))
                          + stream)
    reader = protocol.FrameReader(io.BytesIO(proc.stdout).read)
    reader.skip_to_magic()
    reader.read_json("hello")
    answer = reader.read_json("the reply")
    ok = answer["t"] == "reply"
    out = json.dumps(answer["body"] if ok else answer["message"]).encode()
    return subprocess.CompletedProcess(proc.args, 0 if ok else 1, out, proc.stderr)


def test_receive_refuses_a_stream_that_escapes(tmp_path: Path) -> None:
    root, victim = tmp_path / "job" / "data", tmp_path / "job" / "victim"
    victim.parent.mkdir()
    victim.write_text("keep me")
    absolute = tmp_path / "abs-evil"
    for stream in (frame("../evil", b"x"), frame(str(absolute), b"x"), frame("w0//x", b"x"),
                   frame("w0/./x", b"x"), frame("", b"x"),
                   frame("w0/../../evil", b"x"), frame("w0/ok.bin", b"ok") + end(["../victim"])):
        res = receive(root, stream + end())
        assert res.returncode != 0 and b"unsafe" in res.stdout, res.stdout + res.stderr
    assert victim.read_text() == "keep me"
    assert not absolute.exists()
    assert not [p for p in tmp_path.rglob("*evil*")], "a file landed outside data/"
    # a backslash separates nothing on POSIX: such a name is one name, inside data/
    res = receive(root, frame("w0\\..\\x", b"x") + end())
    assert res.returncode == 0, res.stdout + res.stderr
    assert (root / "w0\\..\\x").read_bytes() == b"x"


def test_receive_never_shows_a_half_written_or_corrupt_file(tmp_path: Path) -> None:
    root = tmp_path / "data"
    payload = os.urandom(300_000)
    bad = receive(root, frame("w0/a.bin", payload, digest="0" * 64) + end())
    assert bad.returncode != 0 and b"digest mismatch" in bad.stdout
    cut = receive(root, frame("w0/a.bin", payload)[:100_000])
    assert cut.returncode != 0
    assert not (root / "w0" / "a.bin").exists()
    ok = receive(root, frame("w0/a.bin", payload) + end())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (root / "w0" / "a.bin").read_bytes() == payload
    assert sorted(os.listdir(root / "w0")) == ["a.bin"], "a half-written file was left"
