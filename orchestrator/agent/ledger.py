"""What orch pushed into a job's code/ or data/ on a host: the only files it reports or deletes there.

The job runs with code/ as its working folder, so code/ also holds what the job wrote
(checkpoints, __pycache__, lightning_logs/). orch must never delete those: the host
remembers, per folder, every file and link it received, in
``<job>/run/<folder>-pushed.json`` ({"version": 1, "files": {rel: [size, digest, key]}},
key = size:mtime_ns:inode:device:ctime_ns, digest = sha256 or "link:<target>"), written atomically at the
end of each receive. While a receive runs, each file that lands is also appended to
``run/<folder>-pushed.journal``, so a receiver killed half way (SIGKILL, a crash) still
leaves a record of what it placed; the next read merges the journal in. A new top folder
written in a staging folder is recorded instead by the ledger written right after it is
renamed into place (files.Staging.promote): the same record at the same moment, without a
journal line of its every file.

The manifest the host reports is the ledger's files that are still there; only those can
be deleted. A host with only the old digest cache (every file of the folder, the job's
included) starts with an empty ledger: nothing unknown is ever deleted, and the next
push sends what it does not know again and records it.

Stdlib only, Python 3.8 (the agent's bundle carries it).
"""
from __future__ import annotations

import hashlib
import marshal
import os
import stat

from orchestrator.agent.paths import (
    READ_FLAGS,
    JobDir,
    UnsafePath,
    open_file_at,
    split_rel,
)
from orchestrator.wire import jsonc, protocol

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

LEDGER_CAP = 1 << 30      # about 5 million entries; a bigger file is not orch's
VERSION = 1
SIG_VERSION = 1


def stat_key(st: os.stat_result) -> str:
    """size:mtime_ns:inode:device:ctime_ns. mtime can be set back by anyone (`touch -d`);
    ctime cannot, and moves with every write: a file rewritten in place with its size
    and mtime kept still differs here. A ledger of an older orch (size:mtime:inode)
    matches no file: each is hashed once more and recorded again."""
    return "%d:%d:%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)


def hash_at(pfd: int, name: str, shown: str) -> str:
    return sha256_fd(open_file_at(pfd, name, shown, READ_FLAGS))


def sha256_fd(fd: int) -> str:
    """The sha256 of all that fd reads; fd is closed (the controller's pull uses it too)."""
    h = hashlib.sha256()
    try:
        for block in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(block)
    finally:
        os.close(fd)
    return h.hexdigest()


def valid_entry(rel: Any, entry: Any) -> bool:
    """An entry as orch writes it; anything else in the file is dropped (safe: an entry
    dropped is a file never deleted)."""
    try:
        split_rel(rel)
    except UnsafePath:
        return False
    return (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
            and isinstance(entry[1], str) and isinstance(entry[2], str) and rel != "")


class Ledger:
    """The files orch placed in one folder ("code" or "data") of a JobDir."""

    def __init__(self, jd: "JobDir", folder: str) -> None:
        self.jd, self.folder = jd, folder
        self.path = "run/%s-pushed.json" % folder
        self.journal_path = "run/%s-pushed.journal" % folder
        self.sig_path = "run/%s-pushed.sig" % folder
        self.files: dict[str, Any] = {}
        self.journal_fd: int | None = None
        self.found = False         # a ledger file was there
        self.interrupted = False   # a journal was there: a receiver did not finish
        self.dirty = False
        self.load()

    # ------------------------------------------------------------ the file

    def load(self) -> None:
        try:
            raw = self.jd.read(self.path, LEDGER_CAP)
            doc = jsonc.loads(raw.decode()) if raw is not None else None
        except (ValueError, UnicodeDecodeError):
            doc = None   # damaged: as if there were none (nothing is deleted)
        if isinstance(doc, dict) and doc.get("version") == VERSION and \
                isinstance(doc.get("files"), dict):
            self.found = True
            self.files = {r: e for r, e in doc["files"].items() if valid_entry(r, e)}
        journal = self.jd.read(self.journal_path, LEDGER_CAP)
        if journal is not None:
            self.interrupted = self.dirty = True
            self.replay(journal)

    def replay(self, journal: bytes) -> None:
        """Each line: [[rel, entry], ...] (one write of record_many), or [rel, entry]
        (an older orch's)."""
        for line in journal.splitlines():
            try:
                got = jsonc.loads(line.decode())
            except (ValueError, UnicodeDecodeError):
                continue   # the torn last line of a killed receiver
            pairs = got if isinstance(got, list) and got and isinstance(got[0], list) else [got]
            for pair in pairs:
                if isinstance(pair, list) and len(pair) == 2 and valid_entry(*pair):
                    self.files[pair[0]] = pair[1]

    def begin(self) -> None:
        """A receive starts: from now on every file placed is journaled at once."""
        self.journal_fd = self.jd.open_for_write(self.journal_path, 0o644, append=True)

    def save(self) -> bool:
        """Write the ledger atomically (and its signature), then drop the journal it now
        contains. True when it was written."""
        had_journal = self.journal_fd is not None or self.interrupted
        wrote = self.dirty or had_journal or not self.found
        if wrote:
            doc = {"version": VERSION, "files": self.files}
            self.jd.unlink(self.sig_path)   # never a signature of another ledger than this one
            self.jd.write_file(self.path, jsonc.dumps(doc, separators=(",", ":")).encode(), 0o644)
            self.dirty, self.found = False, True
            self.write_sig()
        if self.journal_fd is not None:
            os.close(self.journal_fd)
            self.journal_fd = None
        if had_journal:
            self.jd.unlink(self.journal_path)
            self.interrupted = False
        return wrote

    # ------------------------------------------------------------ entries

    def record(self, rel: str, st: os.stat_result, digest: str) -> None:
        """rel was placed by orch (st: its stat at that moment)."""
        self.record_many([(rel, st, digest)])

    def record_many(self, placed: list[Any], journal: bool = True) -> None:
        """[(rel, stat, digest)] placed by orch: one journal write for all of them.
        journal=False: the caller writes the ledger itself right away (save()), which
        records them as the journal would, and a journal line would be 10 MB of JSON a
        hundred thousand files for nothing (Staging.promote says why that is safe)."""
        files = self.files
        for rel, st, digest in placed:
            files[rel] = [st.st_size, digest, "%d:%d:%d:%d:%d" % (
                st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)]   # stat_key
        self.dirty = self.dirty or bool(placed)
        if self.journal_fd is not None and placed and journal:   # one line: json's C encoder
            pairs = [[rel, files[rel]] for rel, _, _ in placed]
            data = (jsonc.dumps(pairs, separators=(",", ":")) + "\n").encode()
            while data:
                data = data[os.write(self.journal_fd, data):]

    def owns(self, rel: str) -> bool:
        return rel in self.files

    def forget(self, rel: str) -> None:
        if self.files.pop(rel, None) is not None:
            self.dirty = True

    # ------------------------------------------------------------ the manifest

    def manifest(self) -> dict[str, Any]:
        """{rel: [size, digest]} of the ledger's entries still there as orch left them
        (a regular file, or the link orch made). A file changed since (new size, mtime
        or inode) is hashed again; one gone, or replaced by a folder or another kind of
        entry, is dropped from the ledger: it is no longer orch's.

        This is what lets a nothing-changed push skip the files: a regular file whose
        lstat gives the key recorded when orch wrote it (size, mtime_ns, inode) is
        trusted to hold the digest recorded then. Only orch's receiver writes that
        record, after verifying the bytes; a write by anyone else moves mtime, a
        replacement changes the inode. One lstat per file, as rsync's quick check
        makes on its receiving side, and no byte read."""
        by_parent = group_by_parent(self.files)
        report: dict[str, Any] = {}
        for parent in sorted(by_parent):
            where = self.folder + "/" + parent if parent else self.folder
            prefix = parent + "/" if parent else ""
            try:
                fd = self.jd.open_dir(where)
            except FileNotFoundError:
                for name in by_parent[parent]:
                    self.forget(prefix + name)
                continue
            try:
                self.check_folder(fd, prefix, by_parent[parent], report)
            finally:
                os.close(fd)
        return report

    def check_folder(self, pfd: int, prefix: str, names: list[str], report: dict[str, Any]) -> None:
        """check() for each name of one folder; the unchanged regular file (nearly every
        one, in a nothing-changed push) costs an lstat and a string compare."""
        files, lstat, isreg = self.files, os.stat, stat.S_ISREG
        for name in names:
            rel = prefix + name
            entry = files[rel]
            try:
                st = lstat(name, dir_fd=pfd, follow_symlinks=False)
            except FileNotFoundError:
                self.forget(rel)
                continue
            if isreg(st.st_mode) and entry[2] == stat_key(st) and \
                    not entry[1].startswith("link:"):
                report[rel] = [st.st_size, entry[1]]
            else:
                self.check(pfd, rel, name, st, report)

    def check(self, pfd: int, rel: str, name: str, st: os.stat_result,
              report: dict[str, Any]) -> None:
        entry = self.files[rel]
        is_link = entry[1].startswith("link:")
        if is_link and stat.S_ISLNK(st.st_mode):
            digest = "link:" + os.readlink(name, dir_fd=pfd)
        elif not is_link and stat.S_ISREG(st.st_mode):
            digest = entry[1] if stat_key(st) == entry[2] else \
                hash_at(pfd, name, self.jd.show(self.folder + "/" + rel))
        else:
            self.forget(rel)
            return
        if [st.st_size, digest, stat_key(st)] != entry:
            self.files[rel] = [st.st_size, digest, stat_key(st)]
            self.dirty = True
        report[rel] = [st.st_size, digest]

    # ------------------------------------------------------------ the signature

    def write_sig(self) -> None:
        """``run/<folder>-pushed.sig``: the ledger in the form a nothing-changed check
        reads fastest (marshal: {"version", "token", "folders": [[parent, [names]]],
        "keys": sha256 of the stat keys in that order}). While every file's stat key is
        the one recorded, the folder holds exactly the ledger's files, whose manifest
        token is `token` (same()). Written after the ledger: a stale one fails its keys.

        One sort of the paths serves all three: the token hashes them in path order,
        and `folders` lists them in that order too, as runs of one parent (a parent
        comes back after a sub-folder only for names sorting on both sides of it,
        "b-1", "b/", "b0": a few runs a folder at most). No grouping dict, no tuple or
        path joined per file: at the end of a receive of 100,000 files this was half
        of the signature's time."""
        files = self.files
        rels = sorted(files)
        entries = [files[rel] for rel in rels]
        doc = {"version": SIG_VERSION,
               "token": protocol.sorted_token(rels, [e[1] for e in entries]),
               "folders": runs_by_parent(rels), "keys": keys_digest([e[2] for e in entries])}
        try:
            self.jd.write_file(self.sig_path, marshal.dumps(doc, 4), 0o644)
        except OSError:   # a full disk: only the quick check is lost (the ledger stands)
            pass


def runs_by_parent(rels: list[str]) -> list[Any]:
    """[[parent, [names]]] of paths in order: one item per run of paths of one parent,
    the names in the paths' order (same() reads them so)."""
    runs: list[Any] = []
    at, names = None, None
    add = runs.append
    for rel in rels:
        parent, _, name = rel.rpartition("/")
        if parent == at:
            names.append(name)   # type: ignore[union-attr]
        else:
            at, names = parent, [name]
            add([parent, names])
    return runs


def group_by_parent(files: dict[str, Any]) -> dict[str, Any]:
    """{parent: [names]} of the ledger's paths: each was checked as it came in (a
    loaded entry by valid_entry, a recorded one where the receiver opened it)."""
    by_parent: dict[str, Any] = {}
    get = by_parent.get
    for rel in files:
        parent, _, name = rel.rpartition("/")
        names = get(parent)
        if names is None:
            names = by_parent[parent] = []
        names.append(name)
    return by_parent


def keys_digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def same(jd: "JobDir", folder: str, token: str) -> bool:
    """The nothing-changed answer without reading the ledger: True when the folder's
    signature says `token` and every file it names has its recorded stat key (one lstat
    a file, no JSON, no hash of a file). Anything else (no signature, a journal of an
    unfinished receive, one file moved) is False: the full manifest decides."""
    try:
        raw = jd.read("run/%s-pushed.sig" % folder, LEDGER_CAP)
        doc = marshal.loads(raw) if raw is not None else None
    except (ValueError, EOFError, TypeError, OSError):
        return False
    if not isinstance(doc, dict) or doc.get("version") != SIG_VERSION or \
            doc.get("token") != token or not isinstance(doc.get("folders"), list) or \
            jd.lstat("run/%s-pushed.journal" % folder) is not None:
        return False
    try:
        keys = stat_keys(jd, folder, doc["folders"])
    except (OSError, ValueError, TypeError):
        return False
    return keys is not None and keys_digest(keys) == doc.get("keys")


def stat_keys(jd: "JobDir", folder: str, folders: list[Any]) -> list[str] | None:
    """Every named file's stat key (not followed), in order; None when one is gone or a
    name is not a plain one (a signature orch did not write)."""
    keys: list[str] = []
    add, lstat = keys.append, os.stat
    for parent, names in folders:
        split_rel(parent)
        fd = jd.open_dir(folder + "/" + parent if parent else folder)
        try:
            for name in names:
                if "/" in name or name in ("", ".", "..") or "\0" in name:
                    return None
                st = lstat(name, dir_fd=fd, follow_symlinks=False)
                add("%d:%d:%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev,
                                        st.st_ctime_ns))
        finally:
            os.close(fd)
    return keys
