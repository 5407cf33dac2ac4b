"""What the network checks add to `orch up`, on hosts in network namespaces
(tests/netns_bridge.py: own hostname, 127.0.1.1 line, docker0, two interfaces).

Per host count: the probe round as `up` reports it (`probe: ... (K connections, X s)`),
the agent's `learn` (interfaces, hostname, route, listeners) in CPU per host, and the
time from `orch up` to the firewall's error against the same run without a firewall
(both end at `setup: false`, so nothing is launched and no torch is imported).
Needs root, iproute2, unshare, iptables.  python bench/network.py [N ...]
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))

from netns_bridge import BridgeHosts  # noqa: E402

ORCH = [sys.executable, "-m", "orchestrator"]


def inventory(lan: BridgeHosts, base: Path) -> Path:
    (base / "job.py").write_text("print('never runs')\n")
    doc = {"name": "bench-net",
           "ssh": {"user": "root", "identity_file": str(lan.client_key),
                   "known_hosts": str(lan.known_hosts), "connect_timeout": 30},
           "hosts": [{"address": h.address, "remote_dir": str(h.remote_dir)} for h in lan.hosts],
           "python": sys.executable, "code": {"paths": ["job.py"]},
           "job": {"entrypoint": "job.py", "master_port": 29450}, "setup": ["false"]}
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def timed_up(lan: BridgeHosts, base: Path, inv: Path) -> tuple[float, float | None, str]:
    """Seconds to the end, to the network plan's first line (None: never), stderr."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["ip", "netns", "exec", lan.client_ns, *ORCH, "up", str(inv)],
                            cwd=base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    seen: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("network:") and not seen:
                seen.append(time.monotonic() - t0)
    th = threading.Thread(target=read)
    th.start()
    proc.wait(600)
    th.join()
    return time.monotonic() - t0, seen[0] if seen else None, "".join(lines)


def learn_cpu(lan: BridgeHosts) -> float:
    """CPU seconds of one agent's `learn` (with its listeners), in host 0's namespace."""
    code = "\n".join([
        "import time, sys",
        f"sys.path.insert(0, {str(HERE.parent)!r})",
        "from orchestrator.agent import network as n",
        "t = time.process_time()",
        "for _ in range(50):",
        "    n.learn({'toward': '10.252.0.10', 'token': 't', 'listen': True, 'master': True}, 0)",
        "    n.run_close(None)",
        "print((time.process_time() - t) / 50)"])
    out = subprocess.run(["ip", "netns", "exec", lan.hosts[0].ns, sys.executable, "-S", "-c",
                          code], capture_output=True, text=True, check=True).stdout
    return float(out.strip())


def warm_neighbours(lan: BridgeHosts) -> None:
    """Each host's ARP entry for host 0 and its ring neighbour (a UDP datagram each, to
    the discard port), as on a LAN whose hosts already talk: at 200 namespace hosts on
    one 2-core kernel, 200 ARP broadcasts at once, each copied to 200 bridge ports, lost
    a fifth of the hosts' first packets (some "no route" outright): that measured the
    kernel, not the probe."""
    n = len(lan.hosts)
    for h in lan.hosts:
        peers = sorted({lan.hosts[0].lan, lan.hosts[(h.index + 1) % n].lan} - {h.lan})
        code = ("import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for a in {peers!r}: s.sendto(b'x', (a, 9))\ntime.sleep(0.2)")
        lan.run_in_host(h.index, [sys.executable, "-S", "-c", code], capture_output=True)


NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh"


@contextmanager
def neighbour_room(n: int) -> Iterator[None]:
    """The kernel's ARP table is one for every namespace (gc_thresh3: 1024 entries by
    default): 200 namespace hosts, each with entries for host 0, its neighbour and the
    client, overflow it (dmesg: `neighbour: arp_cache: neighbor table overflow!`) and
    packets are dropped: a sixth of the hosts then get no answer from host 0, which
    measured the emulation, not the probe. Raised for the run (a real machine has its
    own table), put back after."""
    old = {k: Path(f"{NEIGH}{k}").read_text().strip() for k in (1, 2, 3)}
    want = {1: 8 * n, 2: 16 * n, 3: 32 * n}
    try:
        for k, v in want.items():
            if v > int(old[k]):
                Path(f"{NEIGH}{k}").write_text(str(v))
        yield
    finally:
        for k in (3, 2, 1):
            Path(f"{NEIGH}{k}").write_text(old[k])


def one(n: int) -> None:
    with neighbour_room(n):
        measure(n)


def measure(n: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="orch-bench-net-"))
    t = time.monotonic()
    lan = BridgeHosts(root / "lan", n).start()
    made = time.monotonic() - t
    try:
        base = root / "job"
        base.mkdir()
        inv = inventory(lan, base)
        warm_neighbours(lan)
        total, plan_at, err = timed_up(lan, base, inv)
        probe = re.search(r"probe: .*\((\d+) connections, ([\d.]+) s\)", err)
        cpu = learn_cpu(lan)
        for h in lan.hosts:
            lan.firewall(h.index, "22,29400:29499")
        fw_total, _, fw_err = timed_up(lan, base, inv)
        lan.open_all()
        ok = "the network check before launch" in fw_err
        took = re.search(r"the network check before launch \(([\d.]+) s\)", fw_err)
        print(f"{n:>4} hosts (namespaces made in {made:.1f} s): probe round "
              f"{probe.group(2) if probe else '?'} s ({probe.group(1) if probe else '?'} "
              f"connections); learn {cpu * 1000:.1f} ms CPU per host; up to the plan "
              f"{plan_at if plan_at is None else round(plan_at, 2)} s, to setup's end "
              f"{total:.2f} s; with the firewall: exit at {fw_total:.2f} s, "
              f"{took.group(1) if took else '?'} s after preflight "
              f"({'the ring named' if ok else 'NOT the expected error'}), "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        if not probe:
            print(err[-2000:])
        if not ok:
            print(fw_err[-2000:])
    finally:
        lan.stop()


def main() -> int:
    for n in [int(a) for a in sys.argv[1:]] or [3, 64]:
        one(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
