"""A stand-in for `python -m torch.distributed.run`, for bench/scale.py only.

At 64 and 128 fake hosts on a 2-core machine, importing the real torch on every host
(2 s of CPU each) would measure the CPU of this machine, not the launchers. The benchmark
copies this file to <standin>/torch/distributed/run.py, beside a torch dist-info, and
points the hosts' `python:` at a wrapper that puts <standin> first on PYTHONPATH; orch and
the pdsh baseline then both run it through the same `python -m torch.distributed.run`.

It honours torchrun's environment contract: it parses --nnodes, --node-rank,
--nproc-per-node, --master-addr, --master-port, --max-restarts (and ignores --log-dir and
the like), then the script or `-m module` and its arguments; it meets the other nodes at
MASTER_ADDR:MASTER_PORT (node 0 listens, every node waits until all have arrived, as the
static rendezvous does), starts nproc children with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK, waits for them and exits with the
worst exit code. Stdlib only: the hosts run it with a plain python.
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time

RENDEZVOUS_S = 300.0
RETRY_MAX_S = 0.5   # the longest pause between a node's tries to reach the master


def parse(argv):
    ap = argparse.ArgumentParser(prog="torchrun (stand-in)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", "--node_rank", type=int, default=0)
    ap.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    ap.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    ap.add_argument("--master-port", "--master_port", type=int, default=29500)
    ap.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    ap.add_argument("--log-dir", "--log_dir", default=None)
    ap.add_argument("-m", "--module", action="store_true")
    ap.add_argument("--no-python", "--no_python", action="store_true")
    ap.add_argument("target")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    return ap.parse_args(argv)


def rendezvous(a):
    """Node 0 accepts nnodes-1 nodes (each says so with one byte: a connection closed
    without it, a launcher's probe of the port, does not count), then releases everyone
    with one byte."""
    if a.nnodes <= 1:
        return
    deadline = time.monotonic() + RENDEZVOUS_S
    if a.node_rank == 0:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((a.master_addr, a.master_port))
        srv.listen(socket.SOMAXCONN)   # probes of the port queue there too
        srv.settimeout(RENDEZVOUS_S)
        peers = []
        while len(peers) < a.nnodes - 1:
            peer = srv.accept()[0]
            peer.settimeout(RENDEZVOUS_S)
            if peer.recv(1):
                peers.append(peer)
            else:
                peer.close()
        for p in peers:
            p.sendall(b"g")
            p.close()
        srv.close()
        return
    pause = 0.05
    while True:
        try:
            s = socket.create_connection((a.master_addr, a.master_port), timeout=5)
            s.sendall(b"n")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            # backing off as TCPStore's client does: 999 nodes trying every 50 ms while
            # node 0 is still starting would be a busy loop on a shared machine
            time.sleep(pause)
            pause = min(2 * pause, RETRY_MAX_S)
    s.settimeout(RENDEZVOUS_S)
    s.recv(1)   # blocks: an idle node costs nothing until the master releases it
    s.close()


def child_env(a, local_rank):
    env = dict(os.environ)
    env.update(RANK=str(a.node_rank * a.nproc_per_node + local_rank),
               LOCAL_RANK=str(local_rank), WORLD_SIZE=str(a.nnodes * a.nproc_per_node),
               LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank),
               MASTER_ADDR=a.master_addr, MASTER_PORT=str(a.master_port),
               TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS=str(a.max_restarts))
    return env


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    rendezvous(a)
    python = [sys.executable, "-u"] + (["-m", a.target] if a.module else [a.target])
    head = [a.target] if a.no_python else python
    children = [subprocess.Popen(head + a.args, env=child_env(a, i))
                for i in range(a.nproc_per_node)]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: [c.send_signal(s) for c in children])
    codes = [c.wait() for c in children]
    bad = [c if c > 0 else 128 - c for c in codes if c != 0]   # a signal: 128 + its number
    return max(bad) if bad else 0


if __name__ == "__main__":
    sys.exit(main())
