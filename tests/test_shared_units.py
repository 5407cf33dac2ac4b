"""Shared job folders without SSH: the grouping from preflight markers over in-process
fake agents (tests/fake_agent.py), what each job folder receives, where setup runs,
and the host side's parts (agent/paths.JobDir.map, create_once, the part marker)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

import fake_agent
from fake_agent import FakeChannel, FakeTransport
from orchestrator.agent import paths, procs
from orchestrator.agent.paths import JobDir
from orchestrator.config.inventory import host_part, parse
from orchestrator.files.localfiles import LocalFile
from orchestrator.session.preflight import shared_groups
from orchestrator.session.session import HostFiles, Session, group_files, whole
from orchestrator.session.setupstep import setup_hosts
from orchestrator.wire import protocol

INVENTORY = """name: fake
hosts:
  - {address: 10.0.0.1, remote_dir: /nfs/orch}
  - {address: 10.0.0.2, remote_dir: /nfs/orch}
  - {address: 10.0.0.3, remote_dir: /scratch/orch}
  - {address: 10.0.0.4, remote_dir: /nfs/orch}
job: {entrypoint: job.py}
"""


class Folders:
    """The hosts' filesystems: a marker name per folder -> the index that wrote it first."""

    def __init__(self) -> None:
        self.markers: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def handlers(self) -> dict:
        def preflight(chan: FakeChannel, msg: dict) -> None:
            folder = msg["job_dir"].rsplit("/", 1)[0]
            share = msg["share"]
            with self.lock:
                leader = self.markers.setdefault((folder, share["nonce"]), share["index"])
            body = {"python": "3.11.0", "executable": "/usr/bin/python3", "torch": "2.3.0",
                    "job_dir": msg["job_dir"], "gpus": 0, "writable": None, "time": 0.0,
                    "hostname": "h", "ssh_connection": "", "running": False,
                    "share_leader": leader}
            if msg["want_port"]:
                body.update(port=29500, port_free=True)
            chan.push(protocol.reply(msg["id"], body))

        def unshare(chan: FakeChannel, msg: dict) -> None:
            chan.push(protocol.reply(msg["id"], {"removed": self.unshare(msg, msg["nonce"])}))

        def launch(chan: FakeChannel, msg: dict) -> None:
            if "unshare" in msg:
                self.unshare(msg, msg["unshare"])
            fake_agent.launch(chan, msg)
        return {"preflight": preflight, "unshare": unshare, "launch": launch}

    def unshare(self, msg: dict, nonce: str) -> bool:
        folder = msg["job_dir"].rsplit("/", 1)[0]
        with self.lock:
            return self.markers.pop((folder, nonce), None) is not None


def preflighted(tmp_path: Path, text: str = INVENTORY):
    cluster = parse(text, tmp_path / "cluster.yaml")
    folders = Folders()
    transports: dict[int, FakeTransport] = {}

    def connector(host):
        transports[host.index] = FakeTransport(host, folders.handlers())
        return transports[host.index]
    session = Session(cluster, connector=connector)
    pre = session.open_and_preflight()
    return cluster, session, pre, folders, transports


def test_hosts_are_grouped_by_the_marker_they_found(tmp_path: Path) -> None:
    _cluster, session, pre, folders, transports = preflighted(tmp_path)
    try:
        assert pre.groups() == [(0, 1, 3), (2,)]
        assert pre.group_of(3) == (0, 1, 3) and pre.group_of(2) == (2,)
        session.close()   # every host was asked to remove the marker
        assert all(any(m["t"] == "unshare" and m["nonce"] == session.run_id
                       for m in t.channel.requests) for t in transports.values())
        assert folders.markers == {}, "the markers are removed"
    finally:
        session.close()


def test_a_launch_removes_the_markers_itself_and_close_asks_nothing_more(
        tmp_path: Path) -> None:
    """Each host's launch carries the preflight's nonce and removes its marker there: no
    `unshare` request of its own (1,000 requests and replies less an `up` of 1,000 hosts)."""
    _cluster, session, pre, folders, transports = preflighted(tmp_path)
    try:
        assert folders.markers
        session.launch(pre)
        session.close()
        for t in transports.values():
            assert [m["t"] for m in t.channel.requests if m["t"] == "unshare"] == []
            assert [m.get("unshare") for m in t.channel.requests
                    if m["t"] == "launch"] == [session.run_id]
        assert folders.markers == {}, "the markers are removed"
    finally:
        session.close()


def test_a_close_removes_markers_only_where_the_request_goes_at_once(tmp_path: Path) -> None:
    """A session that launched nothing removes the markers at its close, but never waits
    for it: behind a writer stuck on a frozen host (Ctrl-C during a push) or into a full
    SSH window the request is not sent, and the close goes on (a marker left so goes with
    a later preflight's sweep). Before, such a close waited 20 s behind the push."""
    _cluster, session, _pre, folders, transports = preflighted(tmp_path)
    links = session.links
    held, done = threading.Event(), threading.Event()

    def writer() -> None:   # a push's writer, stuck on a host that reads nothing
        with links[1].wlock:
            held.set()
            done.wait(30)
    stuck = threading.Thread(target=writer, daemon=True)
    stuck.start()
    held.wait(10)
    transports[2].channel.room = lambda n: False   # type: ignore[method-assign]  # a full window
    closing = threading.Thread(target=session.close, daemon=True)
    try:
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "the close waited behind a busy link"
        asked = {i for i, t in transports.items()
                 if any(m["t"] == "unshare" for m in t.channel.requests)}
        assert asked == {0, 3}
        # hosts 0, 1 and 3 share a folder (one marker, removed by 0's); 2's is left
        assert [folder for folder, _ in folders.markers] == ["/scratch/orch"], folders.markers
    finally:
        done.set()
        stuck.join(10)
        session.close()


def test_shared_groups_without_markers_keep_hosts_apart() -> None:
    assert shared_groups({0: 0, 1: 0, 2: 2, 3: -1, 4: -1}) == [(0, 1), (2,), (3,), (4,)]
    assert shared_groups({0: 1, 1: 1}) == [(0, 1)]   # whoever wrote first: one group


def lf(rel: str) -> LocalFile:
    return LocalFile(rel, "/x/" + rel, 1, 0o644, "d-" + rel)


def test_a_shared_folder_gets_the_code_once_and_each_members_shards(tmp_path: Path) -> None:
    _cluster, session, pre, _folders, _transports = preflighted(tmp_path)
    session.close()
    code = [lf("job.py")]
    files = {i: HostFiles(code, [lf(f"worker_{i}_of_4/a"), lf("common/b")]) for i in range(4)}
    grouped = group_files(files, pre)
    assert sorted(grouped) == [0, 2], "one push per job folder"
    assert grouped[0].code == code
    assert [f.rel for f in whole(grouped[0].data) or []] == [
        "worker_0_of_4/a", "common/b", "worker_1_of_4/a", "worker_3_of_4/a"]
    assert [f.rel for f in whole(grouped[2].data) or []] == ["worker_2_of_4/a", "common/b"]


@pytest.mark.parametrize("once_per", ["filesystem", "host"])
def test_setup_runs_once_per_folder_or_on_each_host(tmp_path: Path, once_per: str) -> None:
    text = INVENTORY + f"setup: {{commands: [pip install -r req.txt], once_per: {once_per}}}\n"
    cluster, session, pre, _folders, _transports = preflighted(tmp_path, text)
    session.close()
    links = {i: object() for i in range(4)}
    where = setup_hosts(cluster, pre, links)   # type: ignore[arg-type]
    if once_per == "filesystem":
        assert where == {0: {"shared": True}, 2: {}}
    else:
        assert where == {0: {"log": f"setup-{host_part('10.0.0.1')}.log"},
                         1: {"log": f"setup-{host_part('10.0.0.2')}.log"},
                         3: {"log": f"setup-{host_part('10.0.0.4')}.log"}, 2: {}}


def test_setup_shapes_stay_valid(tmp_path: Path) -> None:
    for text, once_per in (("setup: [ls]\n", "filesystem"), ("setup: ls\n", "filesystem"),
                           ("setup: {commands: ls, once_per: host}\n", "host")):
        cluster = parse(INVENTORY + text, tmp_path / "cluster.yaml")
        assert cluster.setup is not None and cluster.setup.once_per == once_per
        assert cluster.setup.commands == ("ls",)


# ---------------------------------------------------------------- the host side


def test_part_names_are_plain_and_distinct() -> None:
    assert host_part("10.0.0.1") == "host-10.0.0.1"
    odd = [host_part(label) for label in ("a:22", "a_22", "gpu#3", "a/b")]
    assert len(set(odd)) == 4 and all("/" not in p and ":" not in p for p in odd)


def test_run_maps_to_the_hosts_part_and_shared_names_do_not(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths, "HOST_PART", "host-a")
    jd = JobDir(str(tmp_path / "job"))
    assert jd.map("run") == "run/host-a"
    assert jd.map("run/host.exit") == "run/host-a/host.exit"
    assert jd.map(jd.map("run/x")) == "run/host-a/x", "mapping twice changes nothing"
    for shared in ("run/code-pushed.json", "run/data-receive.lock", "run/shared-setup.json",
                   "code/run/x", "logs/rank-0.log"):
        assert jd.map(shared) == shared
    jd.write_file("run/launch.json", b"{}")
    assert (tmp_path / "job/run/host-a/launch.json").read_bytes() == b"{}"
    assert jd.read("run/launch.json", 10) == b"{}"


def test_create_once_keeps_the_first_writers_content(tmp_path: Path) -> None:
    first, second = JobDir(str(tmp_path / "job")), JobDir(str(tmp_path / "job"))
    assert first.create_once(".orch-share-n1", b"0") == b"0"
    assert second.create_once(".orch-share-n1", b"3") == b"0"
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == [".orch-share-n1"]


def test_a_process_of_another_part_is_not_this_hosts(monkeypatch) -> None:
    monkeypatch.setattr(paths, "HOST_PART", "host-a")
    assert procs.this_part(b"\0ORCH_JOB_DIR=/j\0ORCH_JOB_PART=host-a\0")
    assert not procs.this_part(b"\0ORCH_JOB_DIR=/j\0ORCH_JOB_PART=host-b\0")
    assert procs.this_part(b"\0ORCH_JOB_DIR=/j\0"), "from an orch before parts: this host's"


def test_the_part_folder_itself(monkeypatch, tmp_path: Path) -> None:
    """run/<part> as a whole: its parent is run/ itself, not mapped a second time."""
    monkeypatch.setattr(paths, "HOST_PART", "host-a")
    jd = JobDir(str(tmp_path / "job"))
    assert jd.lstat("run") is None
    jd.write_file("run/x", b"1")
    assert jd.lstat("run") is not None and jd.lstat("run/x") is not None
    assert not jd.rmdir("run"), "not empty"
    jd.unlink("run/x")
    assert jd.rmdir("run") and jd.rmdir_top("run")
    assert list((tmp_path / "job").iterdir()) == []


def test_a_refused_preflight_leaves_no_run_folder(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(paths, "HOST_PART", "host-a")
    from orchestrator.agent.common import job_paths
    p = job_paths(str(tmp_path / "job"))
    p["jd"].fd(create=True)
    assert procs.claim(p) and (tmp_path / "job/run/host-a").is_dir()
    procs.release_all()
    assert list((tmp_path / "job").iterdir()) == []
