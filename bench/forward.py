"""`orch forward` against `ssh -L` on the same host: throughput both ways, the
controller's CPU and peak memory, and the latency of many small connections.

One fake sshd host (SshdCluster(n=1), forwarding allowed). A server in this process
listens on 127.0.0.1 (the host's localhost: the fake hosts share this machine's
loopback). Each method is one long-lived process forwarding a local port to it:
  orch     `orch forward -c cluster.yaml PORT:LOCAL` (paramiko; orch asks for
           aes128-gcm@openssh.com first, ssh/connect.py)
  ssh      `ssh -F <ssh_config> -N -L LOCAL:127.0.0.1:PORT host`: OpenSSH's default
           cipher (chacha20-poly1305 on current OpenSSH), as a user would type it
  ssh-gcm  the same with -c aes128-gcm@openssh.com: cipher for cipher with orch
Through each local port:
  up       N MiB sent to the server (it answers once it has every byte)
  down     N MiB asked of the server (a header, then the bytes)
  small    --requests HTTP-like exchanges (a 300-byte request, a 4 KiB answer, the
           connection closed), --concurrency at a time: a TensorBoard page loading
The methods are interleaved rep by rep (rotating which goes first) so the noise of a
shared machine hits them alike; figures are medians. CPU is the forwarding process's
user+system time (/proc/<pid>/stat) over the transfers, per GB moved; peak RSS its
VmHWM at the end.

    .venv/bin/python bench/forward.py                        # 16, 128, 512 MiB, 3 reps
    .venv/bin/python bench/forward.py --sizes 8 --reps 1 --requests 50   # a quick proof
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common import ORCH, SshdCluster, clean_env, fake_cluster, median, print_table, save_json

MiB = 1 << 20
BLOCK = 1 << 20             # what the client and the server send per call
HEADER = struct.Struct("!cQ")   # op (U up, D down, R request), a size
REQUEST = b"GET /data/run/scalars?tag=loss HTTP/1.1\r\n" + b"X: " + b"y" * 250 + b"\r\n\r\n"
ANSWER = 4096
TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the host's server

class Server:
    """On 127.0.0.1: `U n` reads n bytes then answers b"K"; `D n` sends n bytes; `R n`
    reads a request of n bytes and answers ANSWER bytes; then the connection closes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.payload = memoryview(os.urandom(BLOCK))
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                op, size = HEADER.unpack(read_exactly(conn, HEADER.size))
                if op == b"U":
                    drain(conn, size)
                    conn.sendall(b"K")
                elif op == b"D":
                    send(conn, self.payload, size)
                else:
                    read_exactly(conn, size)
                    conn.sendall(bytes(self.payload[:ANSWER]))
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


def read_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        block = conn.recv(n - len(out))
        if not block:
            raise OSError(f"closed after {len(out)} of {n} bytes")
        out += block
    return bytes(out)


def drain(conn: socket.socket, n: int) -> None:
    buf = bytearray(BLOCK)
    left = n
    while left:
        got = conn.recv_into(buf, min(left, BLOCK))
        if not got:
            raise OSError(f"closed with {left} bytes to come")
        left -= got


def send(conn: socket.socket, payload: memoryview, n: int) -> None:
    left = n
    while left:
        k = min(left, len(payload))
        conn.sendall(payload[:k])
        left -= k


# ---------------------------------------------------------------- the forwarding processes

@dataclass
class Method:
    name: str
    proc: subprocess.Popen[bytes]
    local: int
    ups: list[float] = field(default_factory=list)       # seconds per transfer
    downs: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # "up 16": seconds of CPU
    small: list[list[float]] = field(default_factory=list)
    small_wall: list[float] = field(default_factory=list)


def cpu_of(pid: int) -> float:
    """User + system seconds of a process (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / TICKS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(m: Method, timeout: float = 60.0) -> None:
    """Until a connection to the local port is taken (then closed unused)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m.proc.poll() is not None:
            err = m.proc.stderr.read().decode(errors="replace") if m.proc.stderr else ""
            raise SystemExit(f"{m.name} ended ({m.proc.returncode}): {err[-800:]}")
        try:
            socket.create_connection(("127.0.0.1", m.local), timeout=2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{m.name}: nothing listens on 127.0.0.1:{m.local} after {timeout:.0f} s")


@contextmanager
def methods(cluster: SshdCluster, work: Path, port: int, gcm: bool) -> Iterator[list[Method]]:
    (work / "job.py").write_text("print('hi')\n")
    inv = cluster.write_inventory(work / "cluster.yaml", name="bench-forward")
    host = cluster.hosts[0].address
    cmds = {"orch": lambda lp: [str(ORCH), "forward", "-c", str(inv), f"{port}:{lp}"],
            "ssh": lambda lp: ["ssh", "-F", str(cluster.ssh_config), "-N", "-o",
                               "ExitOnForwardFailure=yes", "-L", f"{lp}:127.0.0.1:{port}", host]}
    if gcm:
        cmds["ssh-gcm"] = lambda lp: [*cmds["ssh"](lp)[:3], "-c", "aes128-gcm@openssh.com",
                                      *cmds["ssh"](lp)[3:]]
    made: list[Method] = []
    try:
        for name, cmd in cmds.items():
            local = free_local_port()
            proc = subprocess.Popen(cmd(local), env=clean_env(), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)
            made.append(Method(name, proc, local))
            wait_listening(made[-1])
        yield made
    finally:
        for m in made:
            if m.proc.poll() is None:
                os.killpg(m.proc.pid, signal.SIGINT if m.name == "orch" else signal.SIGTERM)
            try:
                m.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(m.proc.pid, signal.SIGKILL)
                m.proc.wait()


# ---------------------------------------------------------------- the client's side

def up(local: int, n: int, payload: memoryview) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", local), timeout=120) as s:
        s.sendall(HEADER.pack(b"U", n))
        send(s, payload, n)
        if s.recv(1) != b"K":
            raise SystemExit(f"up {n} bytes through 127.0.0.1:{local}: no answer")
    return time.perf_counter() - t


def down(local: int, n: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", local), timeout=120) as s:
        s.sendall(HEADER.pack(b"D", n))
        drain(s, n)
    return time.perf_counter() - t


def request(local: int) -> float:
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", local), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(HEADER.pack(b"R", len(REQUEST)) + REQUEST)
        got = read_exactly(s, ANSWER)
    if len(got) != ANSWER:
        raise SystemExit("a short answer")
    return time.perf_counter() - t


def measured(m: Method, key: str, step: Callable[[], float]) -> float:
    before = cpu_of(m.proc.pid)
    seconds = step()
    m.cpu[key] = m.cpu.get(key, 0.0) + cpu_of(m.proc.pid) - before
    return seconds


def small_round(m: Method, count: int, concurrency: int) -> None:
    def step() -> float:
        with ThreadPoolExecutor(concurrency) as pool:
            t = time.perf_counter()
            m.small.append(list(pool.map(lambda _: request(m.local), range(count))))
            return time.perf_counter() - t
    m.small_wall.append(measured(m, "small", step))


def rep(order: list[Method], sizes: list[int], payload: memoryview, args: argparse.Namespace
        ) -> None:
    for size in sizes:
        for m in order:
            n, local = size * MiB, m.local
            m.ups.append(measured(m, f"up {size}", lambda: up(local, n, payload)))  # noqa: B023
            m.downs.append(measured(m, f"down {size}", lambda: down(local, n)))  # noqa: B023
    for m in order:
        small_round(m, args.requests, args.concurrency)


# ---------------------------------------------------------------- report

def mbps(size: int, seconds: float) -> float:
    return size * MiB / seconds / 1e6


def report(ms: list[Method], sizes: list[int], reps: int) -> dict[str, object]:
    rows: list[list[object]] = []
    doc: dict[str, object] = {}
    ssh = next(m for m in ms if m.name == "ssh")
    moved = sum(sizes) * MiB * reps * 2 / 1e9
    for i, size in enumerate(sizes):
        for m in ms:
            ups = [m.ups[r * len(sizes) + i] for r in range(reps)]
            downs = [m.downs[r * len(sizes) + i] for r in range(reps)]
            ref_up = median([ssh.ups[r * len(sizes) + i] for r in range(reps)])
            ref_down = median([ssh.downs[r * len(sizes) + i] for r in range(reps)])
            row = {"up_MBps": mbps(size, median(ups)), "down_MBps": mbps(size, median(downs)),
                   "up_vs_ssh": ref_up / median(ups), "down_vs_ssh": ref_down / median(downs),
                   "cpu_s": (m.cpu[f"up {size}"] + m.cpu[f"down {size}"]) / reps}
            doc[f"{m.name} {size} MiB"] = row
            rows.append([m.name, size, f"{row['up_MBps']:.0f}", f"{row['down_MBps']:.0f}",
                         f"{row['up_vs_ssh']:.2f}x / {row['down_vs_ssh']:.2f}x",
                         f"{row['cpu_s']:.2f}"])
    print_table("throughput (medians)", ["method", "MiB", "up MB/s", "down MB/s",
                                         "vs ssh (up / down)", "CPU s per up+down"], rows)
    small_rows = []
    for m in ms:
        lat = sorted(x for r in m.small for x in r)
        bulk = sum(v for k, v in m.cpu.items() if k != "small")
        entry = {"p50_ms": 1e3 * lat[len(lat) // 2], "p95_ms": 1e3 * lat[int(len(lat) * .95)],
                 "wall_s": median(m.small_wall), "small_cpu_s": m.cpu["small"] / reps,
                 "cpu_s_per_GB": bulk / moved, "peak_rss_MiB": peak_rss_mib(m.proc.pid)}
        doc[f"{m.name} small"] = entry
        small_rows.append([m.name, f"{entry['p50_ms']:.1f}", f"{entry['p95_ms']:.1f}",
                           f"{entry['wall_s']:.2f}", f"{entry['small_cpu_s']:.2f}",
                           f"{entry['cpu_s_per_GB']:.2f}", f"{entry['peak_rss_MiB']:.0f}"])
    print_table("small connections, CPU and memory", [
        "method", "p50 ms", "p95 ms", "wall s", "CPU s (small)", "CPU s / GB moved",
        "peak RSS MiB"], small_rows)
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="16,128,512", help="MiB per transfer, comma separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=20)
    p.add_argument("--no-gcm", action="store_true", help="leave ssh -c aes128-gcm out")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    server = Server()
    load = Path("/proc/loadavg").read_text().split()[0]
    try:
        with fake_cluster(1, sshd_options={"AllowTcpForwarding": "yes"}) as cluster, \
                methods(cluster, cluster.root, server.port, not args.no_gcm) as ms:
            for r in range(args.reps):
                rep(ms[r % len(ms):] + ms[:r % len(ms)], sizes, server.payload, args)
            doc = report(ms, sizes, args.reps)
    finally:
        server.close()
    doc["load_at_start"] = load
    print(f"load average at the start: {load}; saved {save_json('forward.json', doc)}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
