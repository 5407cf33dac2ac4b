"""A stand-in `nvidia-smi` for tests: a script put on the hosts' PATH that reports the
GPUs and compute processes a JSON file describes, as the real one formats them.

Each host reads `<ORCH_FAKE_GPUS_DIR>/<its address>.json` (the address sshd accepted the
connection on, from SSH_CONNECTION; `local.json` for a `connection: local` host):
`{"gpus": 4, "util": [..], "mem_used": [..], "apps": [{"gpu": 0, "pid": 123, "mem": 500}]}`.
UUIDs are `GPU-fake-<address>-<index>`: distinct per host, so claims (keyed by UUID) of
the fake hosts, which share one /tmp, do not meet."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SCRIPT = r'''
import json, os, sys
folder = os.environ.get("ORCH_FAKE_GPUS_DIR", "")
addr = (os.environ.get("SSH_CONNECTION", "").split() + ["", "", "local"])[2]
try:
    with open(os.path.join(folder, addr + ".json")) as f:
        spec = json.load(f)
except OSError:
    spec = {"gpus": 0}
n = spec["gpus"]
def uuid(i):
    return "GPU-fake-%s-%d" % (addr, i)
def at(key, i, default):
    values = spec.get(key) or []
    return values[i] if i < len(values) else default
args = sys.argv[1:]
if args == ["-L"]:
    for i in range(n):
        print("GPU %d: Fake GPU 80GB (UUID: %s)" % (i, uuid(i)))
elif args[:1] and args[0].startswith("--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total"):
    for i in range(n):
        print("%d, %s, Fake GPU 80GB, %s, %s, 81920" % (i, uuid(i), at("util", i, 0), at("mem_used", i, 0)))
elif args[:1] and args[0].startswith("--query-compute-apps=gpu_uuid,pid,used_memory"):
    for a in spec.get("apps", []):
        print("%s, %d, %d" % (uuid(a["gpu"]), a["pid"], a.get("mem", 1024)))
else:
    sys.stderr.write("stand-in nvidia-smi: unknown arguments %r\n" % (args,))
    sys.exit(9)
'''


def install(folder: Path, python: str = sys.executable) -> Path:
    """The stand-in as `folder/nvidia-smi` (started with `python`, -S: fast)."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f"#!{python} -S\n{SCRIPT}")
    script.chmod(0o755)
    return script


def describe(folder: Path, address: str, gpus: int, apps: list[dict] | None = None,
             util: list[int] | None = None, mem_used: list[int] | None = None) -> None:
    """What the stand-in reports on the host at `address` ("local" for a local host)."""
    doc = {"gpus": gpus, "apps": apps or [], "util": util or [], "mem_used": mem_used or []}
    (folder / f"{address}.json").write_text(json.dumps(doc))
