"""The agent as the controller sends it: one zip of the packages orchestrator/agent/ and
orchestrator/wire/ compiled by this Python, built deterministically; its sha256 is the
agent's version. Their sources are a second zip, sent only to a host that asks for them.

On the host, BOOT (on the command line) runs the loader (agent/boot.py, the first bytes
on stdin), which reads the zip (the next bytes) and imports it from memory; where its
Python has other bytecode, it asks for the sources first (a `sources` frame before the
hello, answered by the sources' zip on stdin). What stdin carries after that is the
agent's frames. Nothing is installed or written to run it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import marshal
import os
import posixpath
import sys
import zipfile
from pathlib import Path

from orchestrator.config.inventory import Host
from orchestrator.remote import bundlecache

PACKAGE = Path(__file__).parent.parent   # orchestrator/
SHIPPED = ("agent", "wire")               # the packages that travel, whole (stdlib only)
BOOT = ("import sys;exec(compile(sys.stdin.buffer.read(int(sys.argv[1])),"
        "'orch-boot','exec'))")
LOADER = (PACKAGE / "agent" / "boot.py").read_bytes()
EPOCH = (1980, 1, 1, 0, 0, 0)   # zip's earliest date: the same bytes on every build


# given as text to another interpreter (the user's python, whatever its bytecode): the
# warm torchrun's launcher, a rank's start; every host gets these sources
AS_SOURCE = ("orchestrator/agent/launcher.py", "orchestrator/agent/rankexec.py")


@functools.lru_cache(maxsize=1)
def source_files() -> tuple[tuple[str, bytes], ...]:
    """(name in the zip, source), sorted: the packages that travel; the package's
    __init__ is an empty stand-in (the real one belongs to the controller). Read once:
    the bundle compiles them and the sources' zip holds them."""
    files = [("orchestrator/__init__.py", b"")]
    for package in SHIPPED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            files.append((path.relative_to(PACKAGE.parent).as_posix(), path.read_bytes()))
    return tuple(files)


def bundle_files() -> list[tuple[str, bytes]]:
    """(name in the zip, content), sorted: each module compiled by this Python
    (`<name>.pyc`: its code object, marshalled; `orchestrator/MAGIC` says for which
    bytecode), the sources of AS_SOURCE, and `orchestrator/SOURCES`: the sha256 of
    sources()' zip. A host whose Python has the same bytecode loads the compiled code,
    ~20 ms of CPU less at every agent start (most of its start); one with other
    bytecode asks for the sources (agent/boot.py), which only it is sent: they were a
    third of the bundle's bytes, sent to every host at every command."""
    files = source_files()
    compiled = [(name + "c", compiled_code(name, data)) for name, data in files]
    kept = [(name, data) for name, data in files if name in AS_SOURCE]
    return sorted(compiled + kept + [("orchestrator/MAGIC", importlib.util.MAGIC_NUMBER),
                                     ("orchestrator/SOURCES", sources()[1].encode())])


def compiled_code(name: str, source: bytes) -> bytes:
    """The module's code object as the host's loader (agent/boot.py) would compile it:
    the same file name, no __future__ flags of this module inherited. Marshal format 2:
    format 3 and later mark an object shared when its reference count is above one, so
    their bytes depend on what else this process holds (the same modules imported or
    not) and the bundle's digest changed between two builds; 2 has no such marks (1%
    more bytes once deflated). Without docstrings (optimize=2, as `python -OO`): they are
    a tenth of the bundle, sent to every host at every command, and the agent reads none
    (its one assert narrows a type)."""
    code = compile(source, "orch-bundle/" + name, "exec", dont_inherit=True, optimize=2)
    return marshal.dumps(code, 2)


def zipped(files: list[tuple[str, bytes]]) -> tuple[bytes, str]:
    """(zip bytes, sha256 hex): the same files give the same bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files:
            info = zipfile.ZipInfo(name, EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.create_system = 3
            z.writestr(info, data, compresslevel=6)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


@functools.lru_cache(maxsize=1)
def bundle() -> tuple[bytes, str]:
    """(zip bytes, sha256 hex) of what every host is sent: its digest is the agent's
    version, and names the sources' digest too. Kept between commands
    (remote/bundlecache.py), under a key of all its bytes depend on."""
    return bundlecache.cached(build_key(), lambda: zipped(bundle_files()))


def build_key() -> list[bytes]:
    """What the bundle's bytes depend on: the shipped sources, this Python (bytecode and
    marshal) and this module (how it builds)."""
    parts = [b"orch-bundle", importlib.util.MAGIC_NUMBER, sys.version.encode(),
             Path(__file__).read_bytes()]
    for name, data in source_files():
        parts += [name.encode(), data]
    return parts


@functools.lru_cache(maxsize=1)
def sources() -> tuple[bytes, str]:
    """(zip bytes, sha256 hex) of the sources, for a host that asks (other bytecode)."""
    return zipped(sorted(source_files()))


# `python:` may not exist yet when setup makes it (a venv): the agent then runs with the
# host's python3, and preflight says so (ORCH_PYTHON_MISSING)
FALLBACK = ('p="$1"; shift; if ! command -v "$p" >/dev/null 2>&1; then '
            'ORCH_PYTHON_MISSING="$p"; export ORCH_PYTHON_MISSING; p=python3; fi; exec "$p" "$@"')


def host_python(host: Host, job_dir: str, base_dir: str | None = None) -> str:
    """`python:` as a path on the host. A name (`python3`), an absolute or a `~/` path is
    used as written. A relative path is taken, on an SSH host, from the job's `code/`
    folder, where the ranks and `setup:` run (`../venv/bin/python` is `<job dir>/venv/
    bin/python`, the venv a setup `python3 -m venv ../venv` makes), written out whole
    so that it also holds before code/ exists; on a local host, from the inventory's
    folder (`base_dir`; None: the local transport's own folder, which is that one)."""
    python = host.python
    if "/" not in python or python.startswith(("/", "~")):
        return python
    if host.is_local:
        return os.path.join(base_dir, python) if base_dir else python
    return posixpath.normpath(f"{job_dir.rstrip('/')}/code/{python}")


def agent_argv(python: str, label: str = "", fallback: bool = False, part: str = "") -> list[str]:
    """-S: the agent is stdlib only, and a venv's site set-up (.pth files) costs more
    than the agent itself; preflight loads site on its own to find torch. `label`
    (the job dir) is only there so that `ps` shows which job an agent serves. `part`:
    this host's part of the job folder (run/<part>/, agent/paths.PART)."""
    data, _ = bundle()
    argv = [python, "-S", "-c", BOOT, str(len(LOADER)), str(len(data)), str(len(sources()[0])),
            "orch-agent"]
    if label:
        argv.append(label)
    if part:
        argv.append("part=" + part)
    if os.environ.get("ORCH_DEBUG") == "1":
        argv.append("debug")
    if fallback:
        return ["sh", "-c", FALLBACK, "orch-agent"] + argv
    return argv


def agent_stdin() -> bytes:
    """What the agent reads before its first frame: the loader, then the bundle."""
    return LOADER + bundle()[0]
