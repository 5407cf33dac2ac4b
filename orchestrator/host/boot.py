# The agent's loader, run by BOOT (see orchestrator/bundle.py) as the first bytes on
# stdin: it reads the bundle (a zip of orchestrator/protocol.py and orchestrator/host/)
# and imports it from memory. Python >= 3.8, stdlib only, nothing written to disk.
import hashlib
import io
import sys
import zipfile
from importlib.util import spec_from_loader


class Bundle:
    """A meta_path finder and loader over the zip in memory (zipimport needs a file)."""

    def __init__(self, data):
        self.zip = zipfile.ZipFile(io.BytesIO(data))
        self.names = set(self.zip.namelist())
        self.sha256 = hashlib.sha256(data).hexdigest()

    def _path(self, name):
        base = name.replace(".", "/")
        for path, package in ((base + "/__init__.py", True), (base + ".py", False)):
            if path in self.names:
                return path, package
        return None, False

    def find_spec(self, name, path=None, target=None):
        where, package = self._path(name)
        if where is None:
            return None
        return spec_from_loader(name, self, origin="orch-bundle/" + where, is_package=package)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        where = self._path(module.__name__)[0]
        module.__file__ = "orch-bundle/" + where
        exec(compile(self.zip.read(where), module.__file__, "exec"), module.__dict__)

    def get_source(self, name):
        return self.zip.read(self._path(name)[0]).decode("utf-8")


bundle = Bundle(sys.stdin.buffer.read(int(sys.argv[2])))
sys.meta_path.insert(0, bundle)   # before sys.path: the bundle wins over any orchestrator there
from orchestrator.host.main import main  # noqa: E402
main(bundle.sha256, sys.argv[3:])
