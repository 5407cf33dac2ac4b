# The agent's loader, run by BOOT (see orchestrator/remote/bundle.py) as the first bytes on
# stdin: it reads the bundle (a zip of orchestrator/agent/ and orchestrator/wire/)
# and imports it from memory. Python >= 3.8, stdlib only, nothing written to disk.
# The zip is read with struct and zlib, not zipfile: zipfile's imports (pathlib, re,
# urllib...) cost 40-60 ms at every agent start, more than the rest of the agent.
import marshal
import struct
import sys
import zlib
from _frozen_importlib_external import MAGIC_NUMBER  # (already loaded: costs nothing)
from importlib.machinery import ModuleSpec

AGENT_MAGIC = b"\x00\x7fORCH-AGENT\x00"   # wire/frames.MAGIC (the bundle is not loaded yet)

MYPY = False
if MYPY:   # names for the type comments, never imported when the agent starts
    import types  # noqa: F401
    from typing import Any  # noqa: F401


def unzip(data):
    # type: (bytes) -> dict[str, tuple[int, bytes]]
    """{name: (method, raw bytes)} of a zip whose members are stored (0) or deflated (8),
    as bundle() writes; a member is inflated when it is read (see Bundle.read)."""
    end = data.rfind(b"PK\x05\x06")
    count, _, offset = struct.unpack_from("<HII", data, end + 10)
    files, pos = {}, offset
    for _ in range(count):
        method, = struct.unpack_from("<H", data, pos + 10)
        csize, _, nlen, xlen, clen = struct.unpack_from("<IIHHH", data, pos + 20)
        local, = struct.unpack_from("<I", data, pos + 42)
        name = data[pos + 46:pos + 46 + nlen].decode("utf-8")
        lnlen, lxlen = struct.unpack_from("<HH", data, local + 26)
        start = local + 30 + lnlen + lxlen
        files[name] = (method, data[start:start + csize])
        pos += 46 + nlen + xlen + clen
    return files


def sha256(data):
    # type: (bytes) -> Any
    """The builtin sha256: hashlib's import loads OpenSSL (2-3 ms at every agent start)."""
    import importlib
    for name in ("_sha256", "_sha2", "hashlib"):   # Python < 3.12, 3.12+, any
        try:
            return importlib.import_module(name).sha256(data)
        except ImportError:
            continue
    raise ImportError("no sha256")


class Bundle:
    """A meta_path finder and loader over the zip in memory (zipimport needs a file)."""

    def __init__(self, data):
        # type: (bytes) -> None
        self.files = unzip(data)
        self.sha256 = sha256(data).hexdigest()
        # the controller's Python compiled each module: its bytecode is ours, or the
        # sources are asked for (add_sources)
        self.compiled = ("orchestrator/MAGIC" in self.files
                         and self.read("orchestrator/MAGIC") == MAGIC_NUMBER)

    def add_sources(self, data):
        # type: (bytes) -> None
        """The sources' zip, which the bundle names by its sha256."""
        if sha256(data).hexdigest().encode() != self.read("orchestrator/SOURCES"):
            raise SystemExit("orch agent: the sources sent are not the bundle's")
        self.files.update(unzip(data))

    def read(self, name):
        # type: (str) -> bytes
        """A member's bytes (inflated now: most of the bundle is never imported)."""
        method, raw = self.files[name]
        return zlib.decompress(raw, -15) if method == 8 else raw

    def _path(self, name):
        # type: (str) -> tuple[Any, bool]
        # (the path is None only for a name not in the bundle: find_spec filters those)
        base = name.replace(".", "/")
        for path, package in ((base + "/__init__.py", True), (base + ".py", False)):
            if path in self.files or path + "c" in self.files:
                return path, package
        return None, False

    def find_spec(self, name, path=None, target=None):
        # type: (str, object, object) -> ModuleSpec | None
        where, package = self._path(name)
        if where is None:
            return None
        return ModuleSpec(name, self, origin="orch-bundle/" + where,  # type: ignore[arg-type]
                          is_package=package)  # (a loader by its methods, not by class)

    def create_module(self, spec):
        # type: (ModuleSpec) -> None
        return None

    def exec_module(self, module):
        # type: (types.ModuleType) -> None
        where = self._path(module.__name__)[0]
        module.__file__ = "orch-bundle/" + where
        if self.compiled and where + "c" in self.files:
            code = marshal.loads(self.read(where + "c"))
        else:
            code = compile(self.read(where), module.__file__, "exec")
        exec(code, module.__dict__)

    def get_source(self, name):
        # type: (str) -> str | None
        where = self._path(name)[0]   # (None, as loaders say, where only its bytecode came)
        return self.read(where).decode("utf-8") if where in self.files else None


def ask_sources(size):
    # type: (int) -> bytes
    """The sources' zip, asked of the controller by a frame before the hello."""
    ask = b'{"t":"sources"}'
    out = sys.stdout.buffer
    out.write(AGENT_MAGIC + struct.pack(">cI", b"J", len(ask)) + ask)
    out.flush()
    return sys.stdin.buffer.read(size)


bundle = Bundle(sys.stdin.buffer.read(int(sys.argv[2])))
if not bundle.compiled:   # another Python's bytecode: compiled here from the sources
    bundle.add_sources(ask_sources(int(sys.argv[3])))
sys.meta_path.insert(0, bundle)   # before sys.path: the bundle wins over any orchestrator there
from orchestrator.agent.main import main  # noqa: E402

main(bundle.sha256, sys.argv[4:])
