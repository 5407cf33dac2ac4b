"""`job.checkpoint_to: host` without SSH: the key checked with file:line, the choice of
the keeper host and its fallback to the controller, the agent's `keep_receive` (ledger,
prune, refusals), and the relay itself between real agents of `connection: local` hosts
(each with a job folder of its own): what a round sends, what it prunes, what a restart
puts back and from where when the keeper host is lost."""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.config.inventory import Cluster, load
from orchestrator.errors import InventoryError
from orchestrator.session import hostkeep
from orchestrator.session.session import Session
from orchestrator.wire import protocol

CK = "output/checkpoints"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def inventory(tmp_path: Path, hosts: int = 3, job: str = "  checkpoint_to: host\n") -> Path:
    (tmp_path / "job.py").write_text("print('hi')\n")
    lines = ["name: relay", "hosts:"]
    for i in range(hosts):
        lines.append(f"  - {{address: localhost, connection: local, remote_dir: {tmp_path}/h{i}}}")
    lines += ["code: {paths: [job.py]}", "job:", "  entrypoint: job.py", "  restarts: 1"]
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(lines) + "\n" + job)
    return path


# ---------------------------------------------------------------- the key

def test_checkpoint_to_defaults_to_the_controller_and_takes_host(tmp_path: Path) -> None:
    assert load(inventory(tmp_path, job="")).job.checkpoint_to == "controller"
    assert load(inventory(tmp_path)).job.checkpoint_to == "host"
    path = inventory(tmp_path, job="  checkpoint_to: hosts\n")
    with pytest.raises(InventoryError) as info:
        load(path)
    text = str(info.value)
    assert f"{path}:10" in text and "job.checkpoint_to" in text and "controller or host" in text
    assert "did you mean `host`" in (info.value.hint or "")


# ---------------------------------------------------------------- the choice

def test_the_keeper_host_is_the_first_whose_folder_is_not_rank_0s(tmp_path: Path) -> None:
    cluster = load(inventory(tmp_path))
    labels = [h.label for h in cluster.hosts]
    got = hostkeep.choose(cluster, [(0,), (1,), (2,)])
    assert got.host is not None and got.host.label == labels[1]
    assert got.line == (f"checkpoints kept on {labels[1]} (checkpoint_to: host), off rank 0's "
                        f"host {labels[0]}")
    got = hostkeep.choose(cluster, [(0, 1), (2,)])       # host 1 shares rank 0's folder
    assert got.host is not None and got.host.label == labels[2]
    got = hostkeep.choose(cluster, [(0, 1, 2)])
    assert got.host is None and got.line == ("checkpoints kept on the controller, not on a "
                                             f"host: every other host shares {labels[0]}'s job folder")
    alone = load(inventory(tmp_path, hosts=1))
    got = hostkeep.choose(alone, [(0,)])
    assert got.host is None and got.line.endswith("not on a host: the run has one host")


# ---------------------------------------------------------------- the agent

def stream(*items: bytes) -> Any:
    return protocol.FrameReader(io.BytesIO(b"".join(items)).read)


def one_file(rel: str, data: bytes) -> bytes:
    return (protocol.stream_item("file", p=rel, s=len(data), h=sha(data), m=0o644)
            + protocol.frame(protocol.DATA, data))


def end(*delete: str) -> bytes:
    return protocol.stream_item("end", delete=list(delete))


def test_keep_receive_writes_records_and_prunes_only_its_own(tmp_path: Path) -> None:
    from orchestrator.agent import keep
    from orchestrator.agent.paths import JobDir

    job = tmp_path / "job"
    job.mkdir()
    got = keep.receive(stream(one_file(f"{CK}/e1.pt", b"one"), one_file("code/snap.pt", b"s"),
                              end()), JobDir(str(job)))
    assert got == {"files": 2, "bytes": 4, "deleted": 0}
    assert (job / "checkpoints" / CK / "e1.pt").read_bytes() == b"one"
    assert (job / "checkpoints" / "code" / "snap.pt").read_bytes() == b"s"
    assert not (job / "output").exists() and not (job / "code").exists()
    mine = job / "checkpoints" / CK / "mine.pt"     # not put there by orch: never deleted
    mine.write_bytes(b"user")
    got = keep.receive(stream(end(f"{CK}/e1.pt", f"{CK}/mine.pt")), JobDir(str(job)))
    assert got["deleted"] == 1 and not (job / "checkpoints" / CK / "e1.pt").exists()
    assert mine.read_bytes() == b"user"
    assert not list(job.rglob("*.orch-part-*"))


@pytest.mark.parametrize("rel, why", [
    ("data/x.pt", "not under output/ or code/"),
    ("output", "not under output/ or code/"),
    ("output/../../x", "not a plain relative path"),
    ("output/x.orch-part-1", "half-written"),
])
def test_keep_receive_refuses_paths_outside_its_folders(tmp_path: Path, rel: str, why: str) -> None:
    from orchestrator.agent import keep
    from orchestrator.agent.common import AgentError
    from orchestrator.agent.paths import JobDir

    job = tmp_path / "job"
    job.mkdir()
    with pytest.raises(AgentError, match=why):
        keep.receive(stream(one_file(rel, b"x"), one_file(f"{CK}/ok.pt", b"y"), end()),
                     JobDir(str(job)))
    assert not (tmp_path / "x").exists() and not (job / "data").exists()


def test_keep_receive_never_writes_through_a_link(tmp_path: Path) -> None:
    from orchestrator.agent import keep
    from orchestrator.agent.paths import JobDir

    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    (job / "checkpoints").mkdir(parents=True)
    elsewhere.mkdir()
    os.symlink(elsewhere, job / "checkpoints" / "output")
    with pytest.raises(OSError, match="link"):
        keep.receive(stream(one_file(f"{CK}/e1.pt", b"one"), end()), JobDir(str(job)))
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------- the relay, real agents

@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[Cluster, Session, list[str]]]:
    cluster = load(inventory(tmp_path))
    session = Session(cluster).open()
    sent: list[str] = []
    for link in session.links.values():
        submit = link.submit

        def counted(t: str, *a: Any, _submit: Any = submit, **k: Any) -> Any:
            sent.append(t)
            return _submit(t, *a, **k)
        link.submit = counted  # type: ignore[method-assign,assignment]
    try:
        yield cluster, session, sent
    finally:
        session.close()


def job_of(tmp_path: Path, i: int) -> Path:
    return tmp_path / f"h{i}" / "relay"


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, (1e9, 1e9))   # written long ago: past the settle time


def test_a_round_relays_new_files_to_the_keeper_host_and_keeps_none_here(
        tmp_path: Path, relay: tuple[Cluster, Session, list[str]]) -> None:
    cluster, session, sent = relay
    write(job_of(tmp_path, 0) / CK / "epoch-1.pt", b"one")
    write(job_of(tmp_path, 0) / CK / "epoch-2.pt", b"two")
    write(job_of(tmp_path, 0) / CK / ".epoch-3.pt.tmp", b"half")
    keeper = hostkeep.HostKeeper(session, cluster, cluster.hosts[1])
    assert keeper.round(), keeper.last_error
    copy = job_of(tmp_path, 1) / "checkpoints" / CK
    assert sorted(p.name for p in copy.iterdir()) == ["epoch-1.pt", "epoch-2.pt"]
    assert (copy / "epoch-2.pt").read_bytes() == b"two"
    assert keeper.latest() == {f"{CK}/epoch-1.pt": sha(b"one"), f"{CK}/epoch-2.pt": sha(b"two")}
    assert sent.count("keep_receive") == 1 and keeper.pushed == 2
    assert not (cluster.state_dir / "checkpoints").exists()       # nothing kept here
    assert not (cluster.state_dir / hostkeep.RELAY).exists()      # the staging copy is gone
    assert not (job_of(tmp_path, 2) / "checkpoints").exists()
    sent.clear()
    assert keeper.round()                                          # nothing new: listings only
    assert sorted(sent) == ["pull_manifest", "pull_manifest"], sent
    # the job prunes epoch-1 and writes epoch-3: the keeper host mirrors its newest set
    (job_of(tmp_path, 0) / CK / "epoch-1.pt").unlink()
    write(job_of(tmp_path, 0) / CK / "epoch-3.pt", b"three")
    assert keeper.round()
    assert sorted(p.name for p in copy.iterdir()) == ["epoch-2.pt", "epoch-3.pt"]
    assert keeper.deleted == 1 and keeper.pushed == 3


def test_a_lost_keeper_host_is_a_failed_round_never_an_exception(
        tmp_path: Path, relay: tuple[Cluster, Session, list[str]]) -> None:
    cluster, session, _ = relay
    write(job_of(tmp_path, 0) / CK / "epoch-1.pt", b"one")
    keeper = hostkeep.HostKeeper(session, cluster, cluster.hosts[1])
    session.records[1].link.close()   # type: ignore[union-attr]
    session.records[1].link = None
    assert keeper.round() is False and "not connected" in (keeper.last_error or "")
    assert keeper.latest() == {}


def groups(n: int) -> Any:
    return SimpleNamespace(groups=lambda: [(i,) for i in range(n)])


def test_put_back_from_the_keeper_host_then_what_survives_it(
        tmp_path: Path, relay: tuple[Cluster, Session, list[str]]) -> None:
    cluster, session, _ = relay
    labels = [h.label for h in cluster.hosts]
    write(job_of(tmp_path, 0) / CK / "epoch-4.pt", b"four")
    keeper = hostkeep.HostKeeper(session, cluster, cluster.hosts[1])
    assert keeper.round(), keeper.last_error
    (job_of(tmp_path, 0) / CK / "epoch-4.pt").unlink()        # as if rank 0's host were new
    last = hostkeep.Kept()
    last.chosen(cluster, hostkeep.Choice(cluster.hosts[1], ""))
    sent, where, source = hostkeep.put_back(session, groups(3), last)   # type: ignore[arg-type]
    assert sent == [f"{CK}/epoch-4.pt"] and source == f"the copy on {labels[1]}"
    assert sorted(where) == sorted(labels)     # the keeper host's own job folder too
    for i in range(3):
        assert (job_of(tmp_path, i) / CK / "epoch-4.pt").read_bytes() == b"four"
    assert not (cluster.state_dir / hostkeep.RELAY).exists()
    assert not (cluster.state_dir / "checkpoints").exists()
    # the keeper host lost: rank 0's last host, in the new run, is what survives
    last.lost = {labels[1]}
    write(job_of(tmp_path, 0) / CK / "epoch-5.pt", b"five")
    sent, where, source = hostkeep.put_back(session, groups(3), last)   # type: ignore[arg-type]
    assert f"{CK}/epoch-5.pt" in sent
    assert source == f"rank 0's last host {labels[0]} (the keeper host {labels[1]} is lost)"
    # neither left: a controller copy of an earlier run, else nothing
    last.rank0 = "gone.example"
    sent, where, source = hostkeep.put_back(session, groups(3), last)   # type: ignore[arg-type]
    assert (sent, source) == ([], f"nothing survives (the keeper host {labels[1]} is lost)")
    write(cluster.state_dir / "checkpoints" / CK / "epoch-0.pt", b"zero")
    sent, where, source = hostkeep.put_back(session, groups(3), last)   # type: ignore[arg-type]
    assert sent == [f"{CK}/epoch-0.pt"] and source.startswith("the controller's copy")
