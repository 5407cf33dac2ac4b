"""Property tests (hypothesis) where the input space is large: the frame reader against
arbitrary bytes, the pull manifest's and a pushed link's path checks against arbitrary
names, the push plan (controller) and the host's receive against arbitrary before/after
trees, and split-data's partition. Each runs a modest number of examples, no deadline."""
from __future__ import annotations

import hashlib
import io
import os
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from orchestrator.agent.paths import UnsafePath, check_link_target
from orchestrator.errors import HostError
from orchestrator.files import splitdata
from orchestrator.files.localfiles import LocalFile
from orchestrator.files.pull import Entry, check_manifest
from orchestrator.files.sync import plan
from orchestrator.remote import bundle
from orchestrator.wire import protocol

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------- the frame reader

SMALL_CAPS = {protocol.JSON: 64, protocol.DATA: 200, protocol.OUTPUT: 16 + protocol.RANK.size}


def frames_of(data: bytes, cuts: list[int], chunk: int, readinto: bool,
              caps: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], BaseException | None, int]:
    """Every frame a FrameReader gives from `data` delivered in pieces of the sizes in
    `cuts` (cycled); the error that ended it, if any; the most it ever buffered."""
    pos, i = 0, 0

    def read(n: int) -> bytes:
        nonlocal pos, i
        size = min(n, cuts[i % len(cuts)] if cuts else n)
        i += 1
        out = data[pos:pos + size]
        pos += len(out)
        return out

    def fill(view: memoryview) -> int:
        got = read(len(view))
        view[:len(got)] = got
        return len(got)
    reader = protocol.FrameReader(read, caps=caps, chunk=chunk, readinto=fill if readinto else None)
    out: list[tuple[bytes, bytes]] = []
    most = 0
    try:
        while True:
            got = reader.read_frame()
            most = max(most, len(reader.buf))
            if got is None:
                return out, None, most
            out.append((got[0], bytes(got[1])))
    except protocol.ProtocolError as e:   # its own error, and nothing else
        return out, e, max(most, len(reader.buf))


def frame_bytes() -> st.SearchStrategy[bytes]:
    """Well-formed frames (within SMALL_CAPS), mutated or not, with garbage around."""
    one = st.one_of(   # sizes up to a little over each cap
        st.binary(max_size=80).map(lambda p: protocol.frame(protocol.JSON, p)),
        st.binary(max_size=230).map(lambda p: protocol.frame(protocol.DATA, p)),
        st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=24), st.booleans()).map(
            lambda t: protocol.output(*t)))
    return st.one_of(
        st.binary(max_size=600),
        st.lists(one, max_size=8).map(b"".join),
        st.tuples(st.lists(one, max_size=8).map(b"".join), st.binary(max_size=40),
                  st.integers(0, 600)).map(lambda t: t[0][:t[2]] + t[1] + t[0][t[2]:]))


@SETTINGS
@given(data=frame_bytes(), cuts=st.lists(st.integers(1, 300), max_size=5),
       chunk=st.sampled_from([1, 7, 64, 1 << 16]), readinto=st.booleans())
def test_the_frame_reader_takes_any_bytes(data: bytes, cuts: list[int], chunk: int,
                                          readinto: bool) -> None:
    """Whatever comes, the reader returns frames of known kinds within their caps, ends
    cleanly or raises ProtocolError (nothing else), and buffers at most about one frame
    plus one read."""
    frames, err, most = frames_of(data, cuts, chunk, readinto, SMALL_CAPS)
    event("ended by " + (type(err).__name__ if err else "the end of the stream"))
    for kind, payload in frames:
        assert kind in SMALL_CAPS and len(payload) <= SMALL_CAPS[kind], (kind, len(payload))
    biggest = max(SMALL_CAPS.values()) + protocol.HEADER.size
    assert most <= 2 * (biggest + max(chunk, 300)), most
    for kind, payload in frames:   # and what a frame holds decodes or is refused, by name
        try:
            protocol.decode((kind, payload), "a property test")
        except protocol.ProtocolError:
            pass


@SETTINGS
@given(payloads=st.lists(st.tuples(st.sampled_from(sorted(SMALL_CAPS)), st.binary(max_size=21)),
                         max_size=10),
       cuts=st.lists(st.integers(1, 100), min_size=1, max_size=5), readinto=st.booleans())
def test_well_formed_frames_come_back_whole_however_they_are_cut(payloads, cuts, readinto) -> None:
    data = b"".join(protocol.frame(k, p) for k, p in payloads)
    frames, err, _ = frames_of(data, cuts, 1, readinto, SMALL_CAPS)
    assert err is None and frames == payloads


# ---------------------------------------------------------------- path checks

NAME_CHARS = st.characters(codec="utf-8") | st.sampled_from(["/", ".", "\\", "\x00", "\n"])
NAMES = st.one_of(
    st.text(NAME_CHARS, max_size=40),
    st.lists(st.sampled_from(["a", "b.txt", ".", "..", "", "c d", ".orch-part-1", "x" * 256]),
             max_size=6).map("/".join),
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape")))


def stays_inside(rel: str) -> bool:
    """`rel` joined to a folder names something strictly inside it (lexically)."""
    root = "/root/out"
    joined = posixpath.normpath(posixpath.join(root, rel))
    return joined.startswith(root + "/")


@SETTINGS
@given(rel=NAMES)
def test_a_pullable_path_is_plain_and_stays_inside_output(rel: str) -> None:
    why = protocol.pull_path_problem(rel)
    assert isinstance(why, str)
    if why:
        return
    assert stays_inside(rel), rel
    assert posixpath.normpath(rel) == rel and not rel.startswith("/"), rel
    assert ".orch-part-" not in rel and "\0" not in rel, rel
    raw = rel.encode("utf-8", "surrogateescape")   # what the file system is given
    assert os.fsdecode(raw) == rel   # it round-trips: the name written is the name listed
    assert len(raw) <= protocol.MAX_PULL_PATH and all(len(p) <= 255 for p in raw.split(b"/"))


DIGEST = "ab" * 32


@SETTINGS
@given(names=st.lists(NAMES, max_size=6))
def test_a_pull_manifest_is_accepted_only_with_plain_paths_and_no_file_as_folder(names) -> None:
    remote = {n: Entry(1, DIGEST) for n in names}
    try:
        check_manifest("h", remote)
    except HostError as e:
        assert e.exit_code == 3 and "the pull manifest is refused" in e.message
        return
    for rel in remote:
        assert protocol.pull_path_problem(rel) == "" and stays_inside(rel), rel
        for other in remote:   # no accepted file is another's folder
            assert not other.startswith(rel + "/"), (rel, other)


@st.composite
def link_cases(draw: st.DrawFn) -> tuple[str, str]:
    """(where the link is, its target): any name, or k times `..` then names, with k
    around the link's depth (the boundary)."""
    parts = draw(st.lists(st.sampled_from(["a", "b", "pkg", "x.py"]), min_size=1, max_size=4))
    if draw(st.booleans()):
        return "/".join(parts), draw(NAMES)
    k = draw(st.integers(0, len(parts) + 1))
    rest = draw(st.lists(st.sampled_from(["a", "b", "a", "b", ".", "..", ""]), max_size=3))
    return "/".join(parts), "/".join([".."] * k + rest)


@SETTINGS
@given(case=link_cases())
def test_a_pushed_link_is_accepted_only_if_it_points_inside_its_folder(case: tuple[str, str]) -> None:
    """check_link_target: accepted means relative, and resolved from the link's folder
    it stays inside the pushed folder (`..` only at its start)."""
    rel, target = case
    try:
        check_link_target(rel, target)
    except UnsafePath:
        return
    assert target and not target.startswith("/") and "\x00" not in target, target
    resolved = posixpath.normpath(posixpath.join("/root/out", posixpath.dirname(rel), target))
    assert resolved.startswith("/root/out/"), (rel, target, resolved)
    parts = target.split("/")
    ups = next((i for i, p in enumerate(parts) if p != ".."), len(parts))
    assert ".." not in parts[ups:], target


# ---------------------------------------------------------------- the push plan

TREE_NAMES = st.sampled_from(["a.py", "b.py", "pkg/c.py", "pkg/d.txt", "data/e.bin", "f"])
TREES = st.dictionaries(TREE_NAMES, st.sampled_from([b"1", b"2", b"three", b""]), max_size=6)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_files(tree: dict[str, bytes]) -> list[LocalFile]:
    return [LocalFile(rel, "/nowhere/" + rel, len(data), 0o644, sha(data))
            for rel, data in sorted(tree.items())]


@SETTINGS
@given(before=TREES, after=TREES)
def test_the_plan_sends_what_changed_and_deletes_what_went(before, after) -> None:
    """The host has `before` (as orch pushed it); the local tree is now `after`."""
    remote = {rel: [len(data), sha(data)] for rel, data in before.items()}
    send, delete = plan(local_files(after), remote)
    assert [f.rel for f in send] == sorted(rel for rel, data in after.items()
                                           if rel not in before or before[rel] != data)
    assert delete == sorted(set(before) - set(after))
    assert not {f.rel for f in send} & set(delete)


def agent(root: Path, stdin: bytes, request: str) -> dict:
    """One request to a real agent (started as the controller starts it): its reply, the
    manifest's parts merged into "files"."""
    req = protocol.request(request, 1, root=str(root))
    proc = subprocess.run(bundle.agent_argv(sys.executable), capture_output=True, timeout=60,
                          input=bundle.agent_stdin() + req + stdin)
    reader = protocol.FrameReader(io.BytesIO(proc.stdout).read)
    reader.skip_to_magic()
    reader.read_json("hello")
    files: dict = {}
    while True:
        msg = reader.read_json("the reply")
        if msg["t"] == "part":
            files.update(msg["body"]["files"])
            continue
        assert msg["t"] == "reply", (msg, proc.stderr[-2000:])
        return dict(msg["body"], files=files)


def stream(send: list[LocalFile], tree: dict[str, bytes], delete: list[str]) -> bytes:
    out = b""
    for f in send:
        data = tree[f.rel]
        out += protocol.stream_item("file", p=f.rel, s=len(data), m=0o644, h=f.digest)
        out += protocol.frame(protocol.DATA, data) if data else b""
    return out + protocol.stream_item("end", delete=delete)


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".orch")}


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(before=TREES, after=TREES, theirs=st.dictionaries(
    st.sampled_from(["a.py", "job.log", "pkg/c.py", "pkg/ckpt.pt", "data/x"]),
    st.just(b"the job's"), max_size=3))
def test_a_push_makes_the_host_hold_after_and_leaves_the_jobs_files(
        tmp_path_factory: pytest.TempPathFactory, before, after, theirs) -> None:
    """Over a real agent: push `before`, the job writes files of its own (where orch
    pushed none), push `after` by the plan from the host's manifest. The host then holds
    `after` exactly, plus the job's files, untouched: only files orch pushed are ever
    reported or deleted."""
    assume(not set(theirs) & (set(before) | set(after)))
    assume(not any(a.startswith(b + "/") or b.startswith(a + "/")
                   for a in set(theirs) | set(before) | set(after)
                   for b in set(theirs) | set(before) | set(after)))
    root = tmp_path_factory.mktemp("push") / "code"
    first = local_files(before)
    agent(root, stream(first, before, []), "receive")
    for rel, data in theirs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    manifest = agent(root, b"", "manifest")["files"]
    assert set(manifest) == set(before), manifest     # the job's files are not orch's
    send, delete = plan(local_files(after), manifest)
    agent(root, stream(send, after, delete + sorted(theirs)), "receive")   # asked to delete
    assert files_under(root) == {**after, **theirs}
    assert set(agent(root, b"", "manifest")["files"]) == set(after)


# ---------------------------------------------------------------- split-data's partition

GROUPS = st.dictionaries(
    st.sampled_from(["TrainData/cat", "TrainData/dog", "ValidationData/cat", "cls3", "cls4"]),
    st.integers(0, 40), min_size=1, max_size=5)


@SETTINGS
@given(groups=GROUPS, workers=st.integers(1, 9), seed=st.integers(0, 3),
       kind=st.sampled_from(["files", "records"]))
def test_every_file_lands_in_exactly_one_shard_balanced_per_class(groups, workers, seed,
                                                                  kind) -> None:
    files = {key: [(f"{key}/f{i:03d}", i + 1) for i in range(n)] for key, n in groups.items()}
    shards, _notes = splitdata.assign(kind, {k: list(v) for k, v in files.items()}, workers, seed)
    assert [s.name for s in shards] == [f"worker_{r}_of_{workers}" for r in range(workers)]
    dealt = sorted(f for s in shards for f in s.files)
    assert dealt == sorted(f for v in files.values() for f in v)   # each exactly once
    for key, mine in files.items():
        names = {rel for rel, _ in mine}
        counts = [sum(rel in names for rel, _ in s.files) for s in shards]
        assert max(counts) - min(counts) <= 1, (key, counts)
        assert [s.classes[key] for s in shards] == counts, key
    if kind == "files":   # the extras rotate: totals within one file
        totals = [len(s.files) for s in shards]
        assert max(totals) - min(totals) <= 1, totals
    again, _ = splitdata.assign(kind, {k: list(v) for k, v in files.items()}, workers, seed)
    assert [s.files for s in again] == [s.files for s in shards]   # deterministic
    for s in shards:
        assert s.files == sorted(s.files)
    assert os.sep == "/"
