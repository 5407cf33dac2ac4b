"""One local path rule for what `orch up` pushes (orchestrator/files/localfiles.py, shards.py).

A symlink inside a code path or a shard is pushed as a link when its target stays inside
that tree, else refused (exit 2, before any host is touched); shards' links into the
inventory's data.source are pushed as content, whatever manifest.json's `source` says.
manifest.json and .gitignore are untrusted input: every defect is one message, exit 2.
Most tests call the controller's functions; a few run the CLI (its `cli()`, in process)
to prove "exit 2, no traceback, nothing touched"; one starts orch to prove a fresh
process prints no library warning. One test pushes through real sshd.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from helpers import orch, orch_in_process
from orchestrator.config.inventory import load
from orchestrator.errors import DataError
from orchestrator.files import splitdata
from orchestrator.files.localfiles import (
    DigestCache,
    LocalFile,
    Pushable,
    check_entrypoint,
    code_files,
)
from orchestrator.files.shards import host_files, load_split
from orchestrator.files.sync import plan, stream_files
from orchestrator.wire import protocol

EXCLUDE = ("*.pyc", "__pycache__")


# ---------------------------------------------------------------- helpers

def cache(tmp_path: Path) -> DigestCache:
    return DigestCache(tmp_path / ".orch" / "digests.json")


def files_of(base: Path, paths: tuple[str, ...] = ("job",),
             exclude: tuple[str, ...] = EXCLUDE) -> dict[str, LocalFile]:
    return {f.rel: f for f in code_files(base, paths, exclude, cache(base))}


def refused(call: Callable[[], object], *words: str) -> str:
    with pytest.raises(DataError) as info:
        call()
    text = str(info.value)
    for word in words:
        assert word in text, text
    assert info.value.exit_code == 2 and info.value.hint, text
    return text


def job_tree(base: Path) -> Path:
    """base/job: train.py, util/helpers.py, a data file; returns the job folder."""
    job = base / "job"
    (job / "util").mkdir(parents=True)
    (job / "train.py").write_text("print('train')\n")
    (job / "util" / "helpers.py").write_text("X = 1\n")
    (job / "util" / "table.csv").write_text("a,b\n1,2\n")
    return job


def write_inventory(base: Path, *, paths: tuple[str, ...] = ("job",),
                    entrypoint: str = "job/train.py", exclude: list[str] | None = None,
                    data: dict | None = None, procs: int = 1) -> Path:
    """A one-host local inventory; the checks under test run before it is contacted."""
    doc: dict = {"name": "lp", "python": sys.executable,
                 "hosts": [{"address": "localhost", "connection": "local",
                            "remote_dir": str(base / "node"), "procs": procs}],
                 "code": {"paths": list(paths)}, "job": {"entrypoint": entrypoint}}
    if exclude is not None:
        doc["code"]["exclude"] = exclude
    if data is not None:
        doc["data"] = data
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def orch_up(inventory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ORCH_NO_COLOR="1", ORCH_SSH_CONFIG=os.devnull)
    return orch_in_process(inventory.parent, "up", "-c", str(inventory), env=env)


def assert_refused(res: subprocess.CompletedProcess, base: Path, *words: str) -> None:
    """Exit 2, one message with a fix, no traceback, and the host never touched."""
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "fix:" in res.stderr, res.stderr
    for word in words:
        assert word in res.stderr, res.stderr
    assert not (base / "node").exists(), "the host was touched"


def link_digest(target: str) -> str:
    return "link:" + target


# ---------------------------------------------------------------- code: links

def test_code_link_inside_is_pushed_as_a_link_entry(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "alias.py").symlink_to("train.py")                        # relative, same folder
    (job / "util" / "up.py").symlink_to(job / "train.py")            # absolute, inside
    (job / "lib").symlink_to("util", target_is_directory=True)       # a folder
    got = files_of(tmp_path)
    assert sorted(got) == ["job/alias.py", "job/lib", "job/train.py", "job/util/helpers.py",
                           "job/util/table.csv", "job/util/up.py"]
    for rel, target in (("job/alias.py", "train.py"), ("job/util/up.py", "../train.py"),
                        ("job/lib", "util")):
        f = got[rel]
        assert (f.link, f.size, f.digest) == (target, 0, link_digest(target)), f
    assert got["job/train.py"].link is None and got["job/train.py"].size == 15


def test_code_link_outside_is_refused_naming_it(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("password\n")
    (job / "util" / "notes.txt").symlink_to(secret)
    refused(lambda: files_of(tmp_path), str(job / "util" / "notes.txt"), "outside",
            str(secret), "code.exclude")
    # a link into another code path is outside its own tree too
    (job / "util" / "notes.txt").unlink()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.py").write_text("")
    (job / "x.py").symlink_to("../other/x.py")
    refused(lambda: files_of(tmp_path, ("job", "other")), str(job / "x.py"), "outside")


def test_code_link_outside_refused_by_the_cli_before_any_host(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "passwd").symlink_to("/etc/passwd")
    assert_refused(orch_up(write_inventory(tmp_path)), tmp_path, str(job / "passwd"),
                   "/etc/passwd")


def test_dangling_link_is_refused(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "gone.py").symlink_to("nothing-here.py")
    refused(lambda: files_of(tmp_path), str(job / "gone.py"), "dangling", "nothing-here.py")


def test_link_loops_are_refused(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "a").symlink_to("b")
    (job / "b").symlink_to("a")
    refused(lambda: files_of(tmp_path), "loop")
    for p in (job / "a", job / "b"):
        p.unlink()
    (job / "util" / "back").symlink_to("..", target_is_directory=True)   # its own parent
    refused(lambda: files_of(tmp_path), str(job / "util" / "back"), "loop")


def test_code_path_that_is_a_link_is_followed_and_checked_below(tmp_path: Path) -> None:
    """`code.paths: [job]` with job -> src/job: the user named it, so it is the tree;
    links below it are judged against where it really is."""
    real = job_tree(tmp_path / "src")
    (tmp_path / "job").symlink_to(real, target_is_directory=True)
    (real / "alias.py").symlink_to("util/helpers.py")
    got = files_of(tmp_path)
    assert got["job/train.py"].path == str(real / "train.py")
    assert got["job/alias.py"].link == "util/helpers.py"
    (tmp_path / "src" / "shared.py").write_text("")
    (real / "shared.py").symlink_to("../shared.py")   # inside the project, outside the tree
    refused(lambda: files_of(tmp_path), str(real / "shared.py"), "outside")


def test_link_to_a_left_out_file_is_refused_and_left_out_links_are_ignored(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "build.pyc").write_bytes(b"\0")
    (job / "b.py").symlink_to("build.pyc")
    refused(lambda: files_of(tmp_path), str(job / "b.py"), "code.exclude `*.pyc`", "dangle")
    (job / "b.py").unlink()
    (job / "venv").symlink_to("/usr", target_is_directory=True)   # outside, but excluded
    (tmp_path / ".gitignore").write_text("# local things\nvenv\n")
    assert "job/venv" not in files_of(tmp_path)


def test_stream_sends_a_link_as_a_header_without_bytes(tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "alias.py").symlink_to("train.py")
    got = files_of(tmp_path)

    sent = bytearray()
    stream_files(sent.extend, [got["job/alias.py"], got["job/train.py"]], None)
    data = io.BytesIO(bytes(sent))
    reader = protocol.FrameReader(data.read)
    frames = []
    while (f := reader.read_frame()) is not None:
        frames.append(f)
    link_head, file_head, file_data = frames
    assert json.loads(link_head[1]) == {"t": "link", "p": "job/alias.py", "link": "train.py"}
    # a small file goes in a `files` batch: [path, size, sha256, mode], then its bytes
    train = got["job/train.py"]
    assert json.loads(file_head[1]) == {"t": "files", "f": [["job/train.py", 15, train.digest,
                                                             train.mode]]}
    assert file_data == (protocol.DATA, b"print('train')\n")
    # an unchanged link on the host (same "link:" digest) is not sent again
    remote = {"job/alias.py": [0, link_digest("train.py")]}
    send, _ = plan([got["job/alias.py"]], remote)
    assert send == []


# ---------------------------------------------------------------- code: ignore rules

def test_gitignore_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    job_tree(tmp_path)
    (tmp_path / ".gitignore").write_bytes(b"*.log\nd\xe9j\xe0/\n")
    text = refused(lambda: files_of(tmp_path), f"{tmp_path / '.gitignore'}:2", "UTF-8")
    assert "0xe9" in text
    assert_refused(orch_up(write_inventory(tmp_path)), tmp_path, ".gitignore:2", "UTF-8")


def test_a_pattern_python_warns_about_prints_no_library_warning(tmp_path: Path) -> None:
    """`[[a]` and `[--z]` make Python's re warn (FutureWarning) from pathspec's and
    fnmatch's own source lines: a user can do nothing with those. The dry run, which
    compiles every pattern and walks the code, says nothing but its plan."""
    job_tree(tmp_path)
    (tmp_path / ".gitignore").write_text("[[a]x\n")
    inv = write_inventory(tmp_path, exclude=["[[b]y", "c[--z]"])
    res = orch(inv.parent, "up", "-c", str(inv), "--dry-run",
               env=dict(os.environ, ORCH_NO_COLOR="1", PYTHONWARNINGS="default"))
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr and "pattern.py" not in res.stderr, res.stderr


def test_gitignore_invalid_pattern_names_file_line_and_pattern(tmp_path: Path) -> None:
    job_tree(tmp_path)
    (tmp_path / ".gitignore").write_text("*.log\n\n# comment\nfoo\\\n")
    refused(lambda: files_of(tmp_path), f"{tmp_path / '.gitignore'}:4", "'foo\\\\'", "invalid")
    assert_refused(orch_up(write_inventory(tmp_path)), tmp_path, ".gitignore:4", "invalid pattern")
    (tmp_path / ".gitignore").write_text("*.log\n")
    refused(lambda: files_of(tmp_path, exclude=("!",)), "code.exclude", "'!'")


def test_excluded_script_entrypoint_is_refused(tmp_path: Path) -> None:
    job_tree(tmp_path)
    (tmp_path / ".gitignore").write_text("*.csv\n/job/train*\n")
    res = orch_up(write_inventory(tmp_path))
    assert_refused(res, tmp_path, "job.entrypoint 'job/train.py'", ".gitignore:2 `/job/train*`",
                   "!job/train.py")
    (tmp_path / ".gitignore").write_text("*.csv\n/job/train*\n!/job/train.py\n")
    check_entrypoint(tmp_path, ("job",), EXCLUDE, "job/train.py", "cluster.yaml")   # re-included


def test_excluded_module_entrypoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "__init__.py").write_text("")
    (tmp_path / "worker" / "train.py").write_text("")
    res = orch_up(write_inventory(tmp_path, paths=("worker",), entrypoint="worker.train",
                                  exclude=["__pycache__", "train.py"]))
    assert_refused(res, tmp_path, "job.entrypoint 'worker.train'", "worker/train.py",
                   "code.exclude `train.py`")
    (tmp_path / ".gitignore").write_text("worker/\n")   # the whole package
    refused(lambda: check_entrypoint(tmp_path, ("worker",), EXCLUDE, "worker.train", "inv.yaml"),
            "inv.yaml", ".gitignore:1 `worker/`")
    check_entrypoint(tmp_path, ("worker",), EXCLUDE, "torch.distributed.run", "inv.yaml")


def test_excluded_host_files_are_never_proposed_for_deletion(tmp_path: Path) -> None:
    """The host's own __pycache__ (and code.exclude'd files) stay; stale code goes."""
    job_tree(tmp_path)
    local = list(files_of(tmp_path).values())
    remote = {f.rel: [f.size, f.digest] for f in local}
    remote.update({"job/__pycache__/train.cpython-311.pyc": [10, "x"],
                   "job/util/__pycache__/helpers.cpython-311.pyc": [10, "y"],
                   "job/old.pyc": [1, "z"], "job/stale.py": [1, "s"]})
    send, delete = plan(local, Pushable(tmp_path, ("job",), EXCLUDE)(remote))
    assert send == [] and delete == ["job/stale.py"]


# ---------------------------------------------------------------- shards

def make_split(base: Path, workers: int = 2) -> tuple[Path, Path, Path]:
    """A small ImageFolder source, split; returns (source, shards, inventory)."""
    source = base / "src"
    for c in range(2):
        for i in range(4):
            p = source / f"class{c}" / f"img_{i}.bin"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(64))
    shards = base / "shards"
    splitdata.split(source, shards, workers)
    (base / "job.py").write_text("")
    inv = write_inventory(base, paths=("job.py",), entrypoint="job.py",
                          data={"source": str(source), "shards": str(shards)}, procs=workers)
    return source, shards, inv


def edit_manifest(shards: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = shards / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def all_host_files(inv: Path) -> dict[str, LocalFile]:
    cluster = load(inv)
    split = load_split(cluster)
    return {f.rel: f for f in host_files(cluster, cluster.hosts[0], split, cache(inv.parent))}


def test_split_data_shards_are_pushed_as_content(tmp_path: Path) -> None:
    source, _, inv = make_split(tmp_path, workers=1)
    got = all_host_files(inv)
    assert len(got) == 8 and all(f.link is None for f in got.values())
    f = got["worker_0_of_1/class0/img_0.bin"]
    assert f.path == str(source / "class0" / "img_0.bin") and f.size == 64


def test_shard_link_inside_the_shard_is_pushed_as_a_link(tmp_path: Path) -> None:
    _, shards, inv = make_split(tmp_path, workers=1)
    (shards / "worker_0_of_1" / "first.bin").symlink_to("class0/img_0.bin")
    edit_manifest(shards,
                  lambda m: m["splits"]["1"]["shards"][0]["files"].append(["first.bin", 64]))
    got = all_host_files(inv)
    assert got["worker_0_of_1/first.bin"].link == "class0/img_0.bin"
    assert got["worker_0_of_1/first.bin"].size == 0


def test_shard_link_outside_the_source_is_refused_even_with_a_rewritten_source(
        tmp_path: Path) -> None:
    """The manifest's `source` is rewritten to cover the secret; orch checks the
    inventory's data.source instead."""
    _, shards, inv = make_split(tmp_path)
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not part of the dataset\n")
    split = json.loads((shards / "manifest.json").read_text())["splits"]["2"]
    first = split["shards"][0]["files"][0]
    link = shards / "worker_0_of_2" / first[0]
    link.unlink()
    link.symlink_to(secret)
    edit_manifest(shards, lambda m: m["splits"]["2"].update(source="/"))
    refused(lambda: all_host_files(inv), str(link), "outside", str(secret), "orch split-data")
    assert_refused(orch_up(inv), tmp_path, str(link), "outside")


def test_shard_file_through_a_linked_folder_or_a_linked_shard_is_refused(tmp_path: Path) -> None:
    _, shards, inv = make_split(tmp_path, workers=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("no\n")
    (shards / "worker_0_of_1" / "extra").symlink_to(outside, target_is_directory=True)
    edit_manifest(shards, lambda m: m["splits"]["1"]["shards"][0]["files"].append(
        ["extra/secret.txt", 3]))
    refused(lambda: all_host_files(inv), "extra/secret.txt", "linked folder", str(outside))
    shard = shards / "worker_0_of_1"
    shard.rename(tmp_path / "moved")
    shard.symlink_to(tmp_path / "moved", target_is_directory=True)
    refused(lambda: all_host_files(inv), str(shard), "shard folder is a symlink")


def test_shard_links_need_data_source(tmp_path: Path) -> None:
    _, _, inv = make_split(tmp_path, workers=1)
    doc = yaml.safe_load(inv.read_text())
    del doc["data"]["source"]
    inv.write_text(yaml.safe_dump(doc))
    refused(lambda: all_host_files(inv), "outside", "data.source")


def _nul_escaped(m: dict) -> None:
    m["splits"]["2"]["shards"][0]["files"][0][0] = "class0/a\u0000b.bin"


def _absolute(m: dict) -> None:
    m["splits"]["2"]["shards"][0]["files"].append(["/etc/passwd", 1])


def _dotdot(m: dict) -> None:
    m["splits"]["2"]["shards"][0]["files"].append(["../../src/class0/img_0.bin", 1])


def _top_is_list(m: dict[str, Any]) -> None:
    m.clear()
    m.update({"version": [1]})


BAD_SHAPES: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "top-is-list": (_top_is_list, "version 1"),
    "version-2": (lambda m: m.update(version=2), "version 1"),
    "splits-list": (lambda m: m.update(splits=[1]), "`splits`"),
    "splits-key": (lambda m: m["splits"].update({"two": {}}), "`splits`"),
    "split-not-object": (lambda m: m["splits"].update({"2": [1]}), "not an object"),
    "kind-missing": (lambda m: m["splits"]["2"].pop("kind"), "`kind`"),
    "seed-text": (lambda m: m["splits"]["2"].update(seed="0"), "`seed`"),
    "shards-object": (lambda m: m["splits"]["2"].update(shards={}), "`shards`"),
    "shard-name": (lambda m: m["splits"]["2"]["shards"][1].update(name="worker_0_of_2"), "shard 1"),
    "bytes-negative": (lambda m: m["splits"]["2"]["shards"][0].update(bytes=-1), "shard 0"),
    "file-pair": (lambda m: m["splits"]["2"]["shards"][0]["files"].append([1, 2]), "[path, bytes]"),
    "file-size-text": (lambda m: m["splits"]["2"]["shards"][0]["files"].append(["a", "1"]),
                       "[path, bytes]"),
    "file-twice": (lambda m: m["splits"]["2"]["shards"][0]["files"].append(
        list(m["splits"]["2"]["shards"][0]["files"][0])), "listed twice"),
    "nul-in-path": (_nul_escaped, "unsafe"),
    "absolute": (_absolute, "unsafe"),
    "dotdot": (_dotdot, "unsafe"),
}


@pytest.mark.parametrize("kind", sorted(BAD_SHAPES))
def test_bad_manifest_is_one_message(tmp_path: Path, kind: str) -> None:
    _, shards, inv = make_split(tmp_path)
    edit, word = BAD_SHAPES[kind]
    edit_manifest(shards, edit)
    refused(lambda: all_host_files(inv), "manifest.json", word, "orch split-data")


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "kind-missing", "top-is-list"])
def test_bad_manifest_exits_2_without_traceback(tmp_path: Path, kind: str) -> None:
    _, shards, inv = make_split(tmp_path)
    edit_manifest(shards, BAD_SHAPES[kind][0])
    assert_refused(orch_up(inv), tmp_path, "manifest.json", BAD_SHAPES[kind][1])


RAW_DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "nul-byte": (lambda p: p.write_bytes(p.read_bytes().replace(b"class0", b"cla\0s0", 1)), "NUL"),
    "not-utf8": (lambda p: p.write_bytes(p.read_bytes().replace(b"class0", b"cla\xffs0", 1)),
                 "UTF-8"),
    "not-json": (lambda p: p.write_text(p.read_text()[:-20]), "not valid JSON"),
    "deep": (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "manifest"),
    "huge": (lambda p: os.truncate(p, (256 << 20) + 1), "MiB"),   # sparse: costs no disk
}


@pytest.mark.parametrize("kind", sorted(RAW_DAMAGE))
def test_damaged_manifest_exits_2_without_traceback(tmp_path: Path, kind: str) -> None:
    _, shards, inv = make_split(tmp_path)
    damage, word = RAW_DAMAGE[kind]
    damage(shards / "manifest.json")
    assert_refused(orch_up(inv), tmp_path, f"{shards / 'manifest.json'}", word,
                   "move", "orch split-data --workers 2")


def test_too_many_manifest_entries_are_refused(tmp_path: Path, monkeypatch) -> None:
    from orchestrator.files import shards as shards_mod
    _, _, inv = make_split(tmp_path)
    monkeypatch.setattr(shards_mod, "MAX_FILES", 5)
    refused(lambda: all_host_files(inv), "manifest.json", "more than 5 files")


# ---------------------------------------------------------------- through real sshd

@pytest.mark.ssh
def test_inside_link_lands_as_a_symlink_on_the_host(sshd_cluster, tmp_path: Path) -> None:
    job = job_tree(tmp_path)
    (job / "alias.py").symlink_to("train.py")
    (job / "train.py").write_text("import os\nprint('LINK', os.readlink('job/alias.py'))\n")
    host = sshd_cluster.hosts[0]
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], name="lp-link",
                                       entrypoint="job/train.py", code_paths=["job"])
    res = orch_up(inv)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr
    pushed = host.remote_dir / "lp-link" / "code" / "job" / "alias.py"
    assert pushed.is_symlink() and os.readlink(pushed) == "train.py"
    assert "LINK train.py" in res.stdout
    again = orch_up(inv)   # the host's ledger digest of the link matches: nothing re-sent
    assert again.returncode == 0, again.stderr
    assert "code 0 files 0 B sent" in again.stdout + again.stderr
