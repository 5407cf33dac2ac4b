"""Real networks, in namespaces (tests/netns_bridge.py): two hosts with their own
hostname, Debian's `127.0.1.1 <hostname>` line, a docker0 bridge at 172.17.0.1, and two
interfaces, of which only eth0 reaches the other hosts; the inventory names them by
eth1, an address the hosts do not use between themselves.

pdsh + torchrun on this network: every rank of a gloo job fails with `Gloo
connectFullMesh failed ... Connection refused, remote=[127.0.1.1]:<port>` (gloo binds
what the hostname resolves to), and MASTER_ADDR=<eth1 of host 0> is refused by the
others (no route). `orch up` proves MASTER_ADDR (eth0 of host 0), sets
GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0 and the job runs. With a firewall that
drops all but ssh and the master port, pdsh + torchrun hangs in init_process_group;
`orch up` ends with exit 3 before anything starts, naming the two hosts and the port.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import ORCH, orch, write_job
from netns_bridge import BridgeHosts
from sshd_cluster import pid_alive

pytestmark = [pytest.mark.ssh, pytest.mark.slow]
GLOO_JOB = """\
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""
MASTER_PORT = 29450
# every rank says it started, then waits for the test's go before init_process_group
WAIT_JOB = """\
import os, time
print("ready", flush=True)
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.1)
""" + GLOO_JOB


def _tools() -> str | None:
    for tool in ("ip", "unshare", "iptables"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return tool
    return None


@pytest.fixture(scope="module")
def lan(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BridgeHosts]:
    missing = _tools()
    if os.geteuid() != 0 or missing:
        pytest.skip(f"needs root and {missing or 'iproute2'} (make system-deps)")
    # two hosts: every claim here is about a pair of hosts (a rank of one that cannot
    # reach the other); a third would only add a torchrun and a rank, each importing torch
    hosts = BridgeHosts(tmp_path_factory.mktemp("bridge"), 2).start()
    pids = [h.proc.pid for h in hosts.hosts if h.proc is not None]
    yield hosts
    hosts.stop()   # raises if a pid, a namespace or an /etc/netns folder is left
    assert not [p for p in pids if pid_alive(p)]


def inventory(lan: BridgeHosts, base: Path, name: str, job: str = GLOO_JOB,
              env: dict[str, str] | None = None, **network: Any) -> Path:
    write_job(base, job)
    doc: dict[str, Any] = {
        "name": name,
        "ssh": {"user": "root", "identity_file": str(lan.client_key),
                "known_hosts": str(lan.known_hosts), "connect_timeout": 5},
        "hosts": [{"address": h.address, "remote_dir": str(h.remote_dir)} for h in lan.hosts],
        "python": sys.executable, "code": {"paths": ["job.py"]},
        "job": {"entrypoint": "job.py", "master_port": MASTER_PORT, "env": env or {}}}
    if network:
        doc["network"] = network
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def up(lan: BridgeHosts, base: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return orch(base, "up", *args, timeout=timeout, run=lan.run_in_client)


def up_until(lan: BridgeHosts, base: Path, inv: Path, said: str,
             then: Callable[[str], bool] | None = None, interrupt: bool = True
             ) -> tuple[subprocess.Popen, str]:
    """An attached `orch up` (looks after the launch at 4, 8, 16, ... s), its stdout and
    stderr read as one until a line holds `said` (each line given to `then` first: it
    may act on it), then Ctrl-C (`interrupt`; else it ends on its own); the process and
    everything it wrote."""
    env = dict(os.environ, ORCH_RDZV_NOTICE="4")
    proc = subprocess.Popen(["ip", "netns", "exec", lan.client_ns, *ORCH, "up", str(inv)],
                            cwd=base, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # read by a thread: a silent orch must not hold the test past its deadline (a
    # blocking readline did, for 25 minutes, when the awaited line never came)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    err = ""
    try:
        deadline = time.monotonic() + 120
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            err += line
            if then is not None:
                then(line)
            if said in line or not line:
                break
    finally:
        if not interrupt:   # its own end, within a bound
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=120)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        reader.join(30)
    rest = ""
    while not lines.empty():
        rest += lines.get()
    return proc, err + rest


def read_lines(stream: Any, out: queue.Queue[str]) -> None:
    """Each line of `stream` into `out`, then "" for its end."""
    for line in stream:
        out.put(line)
    out.put("")


def no_job_left(lan: BridgeHosts, name: str) -> None:
    for h in lan.hosts:
        out = lan.run_in_host(h.index, ["sh", "-c", f"grep -l ORCH_JOB_DIR=.*{name} "
                                                    "/proc/[0-9]*/environ 2>/dev/null || true"],
                              capture_output=True, text=True).stdout
        assert not out.strip(), f"{h.hostname}: processes of {name} left: {out}"


def test_hostname_trap_docker0_and_unused_inventory_address(lan: BridgeHosts, tmp_path: Path) -> None:
    """The gloo all-reduce that pdsh + torchrun fails (every rank advertises 127.0.1.1)
    runs under `orch up`: MASTER_ADDR is host 0's eth0 address (the inventory's eth1 is
    not reached by the other hosts), the ranks get eth0, and the plan says what it found."""
    inv = inventory(lan, tmp_path, "net-trap")
    r = up(lan, tmp_path, str(inv))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    text = " ".join((r.stderr + r.stdout).split())
    assert f"MASTER_ADDR={lan.hosts[0].lan}" in text, text
    assert "interface eth0 on" in text and "GLOO_SOCKET_IFNAME" in text, text
    assert "resolves to 127.0.1.1 (loopback)" in text, text
    assert "docker0 172.17.0.1" in text, text
    assert text.count("sum 3") == 2, text   # ranks 0 and 1 add 1 + 2
    st = orch(tmp_path, "status", "-c", str(inv), run=lan.run_in_client)
    assert st.returncode == 0, st.stderr
    shown = " ".join((st.stderr + st.stdout).split())
    assert f"network: MASTER_ADDR={lan.hosts[0].lan}; interface eth0 on" in shown, shown
    js = orch(tmp_path, "status", "-c", str(inv), "--json", run=lan.run_in_client)
    net = json.loads(js.stdout)["network"]
    assert net["master_addr"] == lan.hosts[0].lan and "run_id" not in net, net
    assert [h["interface"] for h in net["hosts"]] == ["eth0"] * 2, net
    doc = json.loads((tmp_path / ".orch" / "net-trap" / "network.json").read_text())
    assert doc["master_addr"] == lan.hosts[0].lan
    assert [h["interface"] for h in doc["hosts"]] == ["eth0"] * 2
    no_job_left(lan, "net-trap")


def test_firewall_ends_before_launch_naming_hosts_and_port(lan: BridgeHosts, tmp_path: Path) -> None:
    """Every host drops all TCP but ssh and 29400-29499: the master port passes, the
    ports the OS picks do not. `orch up` ends with exit 3 within seconds of preflight,
    one message naming the two hosts, the port and the fix; nothing started anywhere."""
    inv = inventory(lan, tmp_path, "net-fw")
    for h in lan.hosts:
        lan.firewall(h.index, "22,29400:29499")
    try:
        t0 = time.monotonic()
        r = up(lan, tmp_path, str(inv), timeout=60)
        took = time.monotonic() - t0
    finally:
        lan.open_all()
    assert r.returncode == 3, r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    err = " ".join(r.stderr.split())
    assert f"{lan.hosts[0].address} -> {lan.hosts[1].address} {lan.hosts[1].lan}:" in err, err
    assert "no answer in 3 s (a firewall drops it)" in err, err
    assert "allow TCP between the hosts of the job" in err, err
    assert "started job" not in err
    # 6-8 s at a load of 10-40 (3 logins, one 3 s bound); 30 s once at a load of 120:
    # the bound only catches a wait of gloo's kind (minutes)
    assert took < 60, took
    no_job_left(lan, "net-fw")
    (tmp_path / "took.txt").write_text(f"{took:.2f}\n")


def test_a_stalled_rendezvous_is_named(lan: BridgeHosts, tmp_path: Path) -> None:
    """`network.check: false`: MASTER_ADDR is the inventory's eth1 address, which the other
    hosts cannot route to, so no node completes torchrun's rendezvous. `orch up` says so
    (where they were to meet, the likely cause) instead of waiting without a word;
    Ctrl-C then stops the job on every host."""
    inv = inventory(lan, tmp_path, "net-rdzv", check=False)
    proc, err = up_until(lan, tmp_path, inv, "rendezvous:")
    text = " ".join(err.split())
    assert f"rendezvous: no host has joined torchrun's rendezvous at {lan.hosts[0].address}:" \
           f"{MASTER_PORT} 4 s after the launch" in text, text
    assert "likely cause" in text and "Traceback" not in text, text
    assert proc.returncode == 130, text
    no_job_left(lan, "net-rdzv")


def test_a_network_hang_in_init_process_group_names_the_host_pair(lan: BridgeHosts,
                                                                  tmp_path: Path) -> None:
    """The firewall of the test above comes up after the probe passed and every rank
    started (each printed `ready`): the ranks then enter init_process_group, and the
    connections to ports the OS picked get no answer. `orch up` names the hang while it
    lasts (which host could not reach which, at what address and port, the fix), not
    gloo's 30 min later."""
    go = tmp_path / "go"
    inv = inventory(lan, tmp_path, "net-hang", job=WAIT_JOB, env={"GO_FILE": str(go)})
    ready: list[str] = []

    def firewall_once_ready(line: str) -> bool:
        if "ready" in line:
            ready.append(line)
            if len(ready) == len(lan.hosts):
                for h in lan.hosts:
                    lan.firewall(h.index, "22,29400:29499")
                go.write_text("go")
        return True
    try:
        proc, err = up_until(lan, tmp_path, inv, "network hang:", then=firewall_once_ready)
    finally:
        lan.open_all()
    text = " ".join(err.split())
    assert "network hang:" in text and "Traceback" not in text, text
    labels, lans = [h.address for h in lan.hosts], [h.lan for h in lan.hosts]
    pairs = [(a, b, c) for a in labels for b, c in zip(labels, lans) if a != b]
    # a waiting connection names the rank; where gloo gave up on it before a look, the
    # host's failed connects and orch's check name the pair
    assert any(f"rank {r} on {a} -> {b} at {c}:" in text for a, b, c in pairs
               for r in range(2)) or any(f"{a} -> {b} at {c}:" in text and "no answer" in text
                                         for a, b, c in pairs), text
    assert "allow TCP between the hosts of the job on every port" in text, text
    assert proc.returncode == 130, text
    no_job_left(lan, "net-hang")



def test_a_refused_connection_in_init_process_group_is_named_as_the_root_cause(
        lan: BridgeHosts, tmp_path: Path) -> None:
    """The firewall comes up after every rank started, as above, but refuses (iptables
    REJECT with a TCP reset) instead of dropping: gloo tries each pair 4 times in about a
    second and init_process_group raises `Connection refused`. The root cause is then
    named as the network: which host could not connect to which, where, and the fix."""
    go = tmp_path / "go"
    inv = inventory(lan, tmp_path, "net-refused", job=WAIT_JOB, env={"GO_FILE": str(go)})
    ready: list[str] = []

    def firewall_once_ready(line: str) -> bool:
        if "ready" in line:
            ready.append(line)
            if len(ready) == len(lan.hosts):
                for h in lan.hosts:
                    lan.firewall(h.index, "22,29400:29499", reject="tcp-reset")
                go.write_text("go")
        return True
    try:
        proc, err = up_until(lan, tmp_path, inv, "the root cause is the network:",
                             then=firewall_once_ready, interrupt=False)
    finally:
        lan.open_all()
    text = " ".join(err.split())
    labels, lans = [h.address for h in lan.hosts], [h.lan for h in lan.hosts]
    pairs = [(a, b, c) for a in labels for b, c in zip(labels, lans) if a != b]
    assert any(f"the root cause is the network: rank {r} on {a} could not connect to {b} "
               f"at {c}:" in text for a, b, c in pairs for r in range(2)), text
    assert "(refused); likely cause: a firewall on" in text and "Traceback" not in \
        text.split("the root cause is the network:")[1], text
    assert "fix: allow TCP between the hosts of the job on every port" in text, text
    assert proc.returncode == 1, text
    no_job_left(lan, "net-refused")



def test_a_refused_store_tried_again_is_named_as_a_network_hang(lan: BridgeHosts,
                                                                 tmp_path: Path) -> None:
    """Every TCP port but ssh's refused (iptables REJECT) once every rank started: the
    rank of host 1 is refused by the store on host 0's master port in
    init_process_group and tries again until torch's timeout (30 min), leaving no waiting
    connection. Its host's count of failed connects grows between two looks; orch
    checks which hosts it reaches on a port the OS picks and names the refused pair."""
    go = tmp_path / "go"
    inv = inventory(lan, tmp_path, "net-retry", job=WAIT_JOB, env={"GO_FILE": str(go)})
    ready: list[str] = []

    def firewall_once_ready(line: str) -> bool:
        if "ready" in line:
            ready.append(line)
            if len(ready) == len(lan.hosts):
                for h in lan.hosts:
                    lan.firewall(h.index, "22", reject="tcp-reset")
                go.write_text("go")
        return True
    try:
        proc, err = up_until(lan, tmp_path, inv, "network hang:", then=firewall_once_ready)
    finally:
        lan.open_all()
    text = " ".join(err.split())
    assert "network hang: failed TCP connects, more at each look:" in text, text
    labels, lans = [h.address for h in lan.hosts], [h.lan for h in lan.hosts]
    pairs = [(a, b, c) for a in labels for b, c in zip(labels, lans) if a != b]
    assert any(f"{a} -> {b} at {c}:" in text for a, b, c in pairs), text
    assert "refused); likely cause: a firewall between" in text, text
    assert "fix: allow TCP between the hosts of the job on every port" in text, text
    assert "Traceback" not in text and proc.returncode == 130, text
    no_job_left(lan, "net-retry")
