"""known_hosts at scale: paramiko's HostKeys against orch's IndexedHostKeys
(orchestrator/ssh/knownhosts.py), on a file with a line per host.

Per command, orch loads the file once and looks up every host twice (paramiko's client
asks for the host's keys, then the policy checks the key it got). paramiko compares each
name with every line, and its load compares every line with every line before it; the
index finds plain names in a dict (hashed lines are still tried one by one). CPU seconds
of this process (the load, then the lookups), the best of REPS runs, and the ratio.

    .venv/bin/python bench/knownhosts.py [--hosts 300 1000 3000] [--reps 5]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import paramiko

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from orchestrator.ssh.knownhosts import IndexedHostKeys


def cost(cls: type, path: str, names: list[str], key: paramiko.PKey) -> tuple[float, float]:
    """(load s, lookups s) of one command's use of the file."""
    t0 = time.process_time()
    keys = cls(path)
    t1 = time.process_time()
    for name in names:
        keys.get(name)
        if not keys.check(name, key):
            raise SystemExit(f"{cls.__name__}: {name} not found")
    return t1 - t0, time.process_time() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[300, 1000, 3000])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    key = paramiko.ECDSAKey.generate()
    print("| hosts | paramiko load s | paramiko lookups s | orch load s | orch lookups s | ratio |")
    print("|---|---|---|---|---|---|")
    for n in args.hosts:
        names = [f"[127.0.{1 + i // 250}.{1 + i % 250}]:22" for i in range(n)]
        with tempfile.NamedTemporaryFile("w", suffix="known_hosts") as f:
            f.write("".join(f"{name} {key.get_name()} {key.get_base64()}\n" for name in names))
            f.flush()
            theirs = min((cost(paramiko.HostKeys, f.name, names, key) for _ in range(args.reps)),
                         key=sum)
            ours = min((cost(IndexedHostKeys, f.name, names, key) for _ in range(args.reps)),
                       key=sum)
        print(f"| {n:,} | {theirs[0]:.3f} | {theirs[1]:.3f} | {ours[0]:.3f} | {ours[1]:.3f} "
              f"| {sum(ours) / sum(theirs):.2f} |", flush=True)


if __name__ == "__main__":
    main()
