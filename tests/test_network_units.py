"""The network plan without hosts: `network:` in cluster.yaml, the choice of MASTER_ADDR
and of each host's interface from what preflight learnt, the plan as shown, and the
agent's side on loopback (its facts, the listeners' tokens, a probe that answers as
soon as the best address is known)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from netns_cluster import ip as netns_ip
from orchestrator.agent import network as agent_net
from orchestrator.agent.warm import matches
from orchestrator.config.inventory import parse
from orchestrator.errors import HostError, InventoryError
from orchestrator.session import netprobe, network
from orchestrator.session.launch import dry_run_plan
from orchestrator.session.replies import Iface, NetFacts, Probed, Target

BASE = "name: n\nhosts:\n  - 10.0.0.8\n  - 10.0.0.9\njob: {entrypoint: job.py}\n"


def cluster(tmp_path: Path, extra: str = "", hosts: str = "") -> Any:
    text = BASE.replace("  - 10.0.0.8\n  - 10.0.0.9\n", hosts) if hosts else BASE
    return parse(text + extra, tmp_path / "cluster.yaml")


def facts(*ifaces: tuple[str, list[str]], resolves: str = "127.0.1.1", src: str = "",
          env: dict[str, str] | None = None, port: int = 40000) -> NetFacts:
    return NetFacts.of({"hostname": "h", "resolves": [resolves], "route_src": src, "boot_id": "b",
            "env": env or {}, "port": port, "master_listen": 29450,
            "interfaces": [{"name": n, "addrs": a, "up": True} for n, a in ifaces]})


LO = ("lo", ["127.0.0.1"])
DOCKER = ("docker0", ["172.17.0.1"])


# ---------------------------------------------------------------- cluster.yaml

def test_network_settings_are_read_top_level_and_per_host(tmp_path: Path) -> None:
    c = cluster(tmp_path, "network: {master_addr: 10.0.0.8, interface: [eth0, eth1], check: false}\n",
                hosts="  - 10.0.0.8\n  - {address: 10.0.0.9, network: {interface: ib0}}\n")
    assert c.network.master_addr == "10.0.0.8"
    assert c.network.interface == ("eth0", "eth1")
    assert c.network.check is False
    assert c.hosts[0].interface is None and c.hosts[1].interface == ("ib0",)
    auto = cluster(tmp_path, "network: {interface: auto}\n")
    assert auto.network.interface is None and auto.network.check is True


@pytest.mark.parametrize("text, line, says", [
    ("network:\n", 6, "`network` has no value"),
    ("network: {check: yes please}\n", 6, "`network.check` must be true or false"),
    ("network: {interface: 'eth 0'}\n", 6, "must be auto or interface names"),
    ("network: {interface: [auto, eth0]}\n", 6, "mixes auto with names"),
    ("network: {master: 10.0.0.8}\n", 6, "unknown key `network.master`"),
    ("network: {master_addr: 'a b'}\n", 6, "is not an address or a host name"),
])
def test_bad_network_settings_name_their_line(tmp_path: Path, text: str, line: int,
                                              says: str) -> None:
    with pytest.raises(InventoryError) as err:
        cluster(tmp_path, text)
    assert f"cluster.yaml:{line}:" in str(err.value) and says in str(err.value), str(err.value)


def test_a_host_takes_only_interface(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as err:
        cluster(tmp_path, hosts="  - 10.0.0.8\n  - {address: 10.0.0.9, network: {check: false}}\n")
    assert "unknown key `hosts[1].network.check`" in str(err.value)
    assert "top-level `network:`" in err.value.hint


# ---------------------------------------------------------------- the plan

def test_master_candidates_prefer_the_inventory_then_host_0s_usable_addresses(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    f0 = facts(LO, DOCKER, ("eth1", ["192.168.9.5"]), ("eth0", ["10.1.0.5"]), src="10.1.0.5")
    assert netprobe.candidates(c, f0, "10.0.0.8") == ["10.0.0.8", "10.1.0.5", "192.168.9.5"]
    over = cluster(tmp_path, "network: {master_addr: 10.9.9.9}\n")
    assert netprobe.candidates(over, f0, "10.0.0.8") == ["10.9.9.9"]


def test_the_interface_is_the_one_that_carried_the_probe(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    f = facts(LO, DOCKER, ("eth0", ["10.1.0.6"]), ("eth1", ["10.0.0.9"]))
    h = network.host_plan(c, c.hosts[1], f, "10.1.0.6", "10.1.0.5", all_lo=False)
    assert h.interface == "eth0"
    assert h.env == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert any("resolves to 127.0.1.1 (loopback)" in x for x in h.found)
    assert any(x.startswith("docker0 172.17.0.1") for x in h.found)


def test_what_the_user_set_is_never_overridden(tmp_path: Path) -> None:
    c = parse(BASE.replace("job: {entrypoint: job.py}",
                           "job: {entrypoint: job.py, env: {NCCL_SOCKET_IFNAME: ib0}}"),
              tmp_path / "cluster.yaml")
    f = facts(LO, ("eth0", ["10.1.0.6"]), env={"GLOO_SOCKET_IFNAME": "eth9"})
    h = network.host_plan(c, c.hosts[1], f, "10.1.0.6", "10.1.0.5", all_lo=False)
    assert h.env == {}
    assert "GLOO_SOCKET_IFNAME set in the host's environment" in h.how
    assert "NCCL_SOCKET_IFNAME set in job.env" in h.how


def test_a_named_interface_must_exist_on_the_host(tmp_path: Path) -> None:
    c = cluster(tmp_path, "network: {interface: eth7}\n")
    f = facts(LO, ("eth0", ["10.1.0.6"]))
    with pytest.raises(HostError) as err:
        network.host_plan(c, c.hosts[1], f, "10.1.0.6", "10.1.0.5", all_lo=False)
    assert "10.0.0.9: network.interface eth7 does not exist there" in err.value.message
    assert "its interfaces: eth0, lo" in err.value.message


def test_lo_or_a_container_bridge_is_never_picked_between_machines(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    # host 0's own machine: the probe to its own address leaves from lo
    f = facts(LO, ("eth0", ["10.1.0.5"]))
    assert network.host_plan(c, c.hosts[0], f, "127.0.0.1", "10.1.0.5", False).interface == "eth0"
    f = facts(LO, DOCKER)
    h = network.host_plan(c, c.hosts[1], f, "172.17.0.1", "10.1.0.5", False)
    assert h.interface is None and h.env == {}
    # one machine: every host reached the master over lo: loopback is right, nothing set
    one = network.host_plan(c, c.hosts[1], facts(LO), "127.0.0.1", "127.0.0.1", True)
    assert one.interface is None and "one machine" in one.how


def test_the_plan_folds_identical_hosts(tmp_path: Path) -> None:
    c = parse(BASE.replace("  - 10.0.0.8\n  - 10.0.0.9\n", "  - gpu[01-04]\n"),
              tmp_path / "cluster.yaml")
    f = facts(LO, DOCKER, ("eth0", ["10.1.0.6"]))
    hosts = {h.index: network.host_plan(c, h, f, "10.1.0.6", "10.1.0.6", False) for h in c.hosts}
    text = "\n".join(network.NetPlan("10.1.0.5", "the inventory's address", hosts, "p").lines())
    assert "interface eth0 on gpu[01-04] (auto" in text, text
    assert "found on gpu[01-04]: hostname resolves to 127.0.1.1" in text, text


def test_choose_master_names_every_host_that_failed_and_why(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    def r(addr: str, ok: bool, why: str = "") -> Probed:
        return Probed(addr, 29450, "", "m", ok, why, "", 0.0, 3.0)
    results = {0: [r("10.0.0.8", True)], 1: [r("10.0.0.8", False, "timeout")]}
    with pytest.raises(HostError) as err:
        netprobe.choose_master(c, ["10.0.0.8"], results)
    msg = err.value.message
    assert "10.0.0.9: cannot reach host 0 (10.0.0.8) on the master port: 10.0.0.8:29450 no " \
           "answer in 3 s (a firewall drops it)" in msg, msg
    assert "allow TCP port 29450" in err.value.hint
    results[1].insert(0, r("10.1.0.5", True))
    results[0].insert(0, r("10.1.0.5", True))
    assert netprobe.choose_master(c, ["10.0.0.8", "10.1.0.5"], results) == "10.1.0.5"


def test_the_plan_is_saved_for_its_run_only(tmp_path: Path) -> None:
    """`orch status --json` carries the plan `up --json` gave, for this run only."""
    c = cluster(tmp_path)
    f = facts(LO, ("eth0", ["10.1.0.6"]))
    hosts = {h.index: network.host_plan(c, h, f, "10.1.0.6", "10.1.0.5", False) for h in c.hosts}
    plan = network.NetPlan("10.1.0.5", "the inventory's address", hosts, "p", 0.25)
    network.save(c, "run-1", plan)
    assert network.load(c, "run-1") == plan.document()
    assert network.load(c, "run-2") is None
    (c.state_dir / "network.json").write_text("[1]")
    assert network.load(c, "run-1") is None


def test_two_saves_of_the_plan_at_once(tmp_path: Path) -> None:
    """Two saves of one job's network.json from two threads: a shared .tmp name made one
    rename find the other's file gone (ENOENT). Each save is whole; nothing is left over."""
    import threading
    c = cluster(tmp_path)
    f = facts(LO, ("eth0", ["10.1.0.6"]))
    hosts = {h.index: network.host_plan(c, h, f, "10.1.0.6", "10.1.0.5", False) for h in c.hosts}
    plan = network.NetPlan("10.1.0.5", "the inventory's address", hosts, "p", 0.25)
    errors: list[BaseException] = []

    def save_often(run_id: str) -> None:
        try:
            for _ in range(300):
                network.save(c, run_id, plan)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=save_often, args=(r,)) for r in ("run-1", "run-2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [network.load(c, r) for r in ("run-1", "run-2")].count(plan.document()) == 1
    assert sorted(p.name for p in c.state_dir.iterdir()) == ["network.json"]


def test_a_dry_run_shows_the_network_plan(tmp_path: Path) -> None:
    plan = dry_run_plan(cluster(tmp_path, "network: {interface: eth0}\n"))
    assert "network: MASTER_ADDR=10.0.0.8 (the inventory's address, else an address of host 0" \
           in plan, plan
    assert "interface on 10.0.0.[8-9]: eth0 -> GLOO_SOCKET_IFNAME" in plan, plan
    one = dry_run_plan(parse(BASE.replace("10.0.0.8", "127.0.0.2").replace("10.0.0.9", "127.0.0.3"),
                             tmp_path / "cluster.yaml"))
    assert "network: MASTER_ADDR=127.0.0.2 (one machine: nothing probed" in one, one


def test_a_named_interface_is_set_on_one_host_or_one_machine_too(tmp_path: Path) -> None:
    """Nothing is probed on one machine, but an interface the inventory names is still
    checked against the host's interfaces and set (a one-host NCCL job on eth0)."""
    one = parse("name: n\nhosts:\n  - {address: 127.0.0.2, network: {interface: eth0}}\n"
                "  - 127.0.0.3\njob: {entrypoint: job.py}\n", tmp_path / "cluster.yaml")
    assert not network.wanted(one) and network.named(one)
    args = network.preflight_args(one, one.hosts[0], "n" * 32)
    assert args["listen"] is False and args["toward"] == ""
    f = facts(LO, ("eth0", ["10.1.0.6"]))
    plan = network.prove(one, {}, {0: f, 1: f}, {}, 29500, "n" * 32)
    assert plan.env(0) == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert plan.hosts[0].how == "network.interface" and plan.env(1) == {}
    assert plan.probe == "none (one machine: the named interfaces set as they are)"
    assert plan.hosts[0].found == ()
    shown = dry_run_plan(one)
    assert "(one machine: nothing probed)" in shown, shown
    assert "interface on 127.0.0.2: eth0 -> GLOO_SOCKET_IFNAME" in shown, shown
    assert "interface on 127.0.0.3: left to torch" in shown, shown
    with pytest.raises(HostError, match=r"network\.interface eth0 does not exist there"):
        network.prove(one, {}, {0: facts(LO), 1: f}, {}, 29500, "n" * 32)
    bare = cluster(tmp_path, hosts="  - 127.0.0.2\n")
    assert not network.named(bare)
    assert network.prove(bare, {}, {0: None}, {}, 29500, "n" * 32).hosts == {}


def test_a_warm_torchrun_takes_the_interface_set_at_launch() -> None:
    env = {"ORCH_JOB": "j"}
    spec: dict[str, Any] = {"argv": ["py", "-m", "torch.distributed.run"],
                            "env": dict(env, GLOO_SOCKET_IFNAME="eth0",
                                        NCCL_SOCKET_IFNAME="eth0")}
    assert matches(spec, "py", env)
    assert not matches(dict(spec, env=dict(spec["env"], OTHER="1")), "py", env)


# ---------------------------------------------------------------- the agent's side

def test_the_agent_learns_its_network_and_answers_the_probe_with_its_token() -> None:
    f = agent_net.learn({"toward": "127.0.0.1", "token": "tok-0", "listen": True,
                         "master": False}, 0)
    try:
        assert {"name": "lo", "addrs": ["127.0.0.1"], "up": True} in f["interfaces"]
        assert f["route_src"] == "127.0.0.1" and f["port"] > 0 and "master_listen" not in f
        got = NetFacts.of(f)   # as the controller decodes the preflight reply's `net`
        assert Iface("lo", ("127.0.0.1",), True) in got.interfaces
        assert (got.route_src, got.port, got.master_listen) == ("127.0.0.1", f["port"], None)
        good = {"addr": "127.0.0.1", "port": f["port"], "token": "tok-0"}
        assert agent_net.connect(good, 1)["ok"]
        assert agent_net.connect(dict(good, token="tok-1"), 1)["why"] == "other"
    finally:
        assert agent_net.run_close(None) == {"closed": 1}   # type: ignore[arg-type]
    assert agent_net.connect(good, 1)["why"] == "refused"


def test_an_interface_is_up_by_its_carrier_whatever_the_lagging_operstate_says(
        tmp_path: Path) -> None:
    """`operstate` lags the link by the kernel's link watch (on Linux 6.18, for up to
    a second): a carrier is read first, operstate only where there is none."""
    def sysfs(name: str, **files: str) -> None:
        (tmp_path / name).mkdir()
        for f, text in files.items():
            (tmp_path / name / f).write_text(text + "\n")
    sysfs("eth0", carrier="1", operstate="down")   # just up: the watch has not run yet
    sysfs("eth1", carrier="0", operstate="up")     # its peer went down a moment ago
    sysfs("eth2", operstate="down")                # administratively down: no carrier
    sysfs("tun0", operstate="unknown")
    got = {n: agent_net.link_state(n, str(tmp_path)) for n in ("eth0", "eth1", "eth2", "tun0",
                                                                "gone")}
    assert got == {"eth0": "up", "eth1": "down", "eth2": "down", "tun0": "unknown",
                   "gone": "unknown"}


def test_a_veth_is_up_at_once_and_down_once_its_peer_is(tmp_path: Path) -> None:
    """On this kernel: a veth just set up is up for the agent at once (the test of the
    hostname trap failed where operstate still said "down"), and down once its peer is."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    tag = os.getpid() % 100000
    a, b = f"orch-va{tag}", f"orch-vb{tag}"
    check = ("import sys; from orchestrator.agent import network as n; "
             "print(n.interface_up(sys.argv[1]))")

    def up_in(ns: str, dev: str) -> str:
        argv = ["ip", "netns", "exec", ns, sys.executable, "-c", check, dev]
        return subprocess.run(argv, capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent.parent).stdout.strip()
    try:
        for ns in (a, b):
            netns_ip("netns", "add", ns)
        netns_ip("link", "add", "v0", "netns", a, "type", "veth", "peer", "name", "v1",
                 "netns", b)
        netns_ip("link", "set", "v1", "up", ns=b)
        netns_ip("link", "set", "v0", "up", ns=a)
        assert up_in(a, "v0") == "True"
        netns_ip("link", "set", "v1", "down", ns=b)
        assert up_in(a, "v0") == "False"
        netns_ip("link", "set", "v0", "down", ns=a)
        assert up_in(a, "v0") == "False"
    finally:
        for ns in (a, b):
            netns_ip("netns", "del", ns, check=False)
    assert a not in netns_ip("netns", "list").stdout


def test_a_probe_answers_once_the_best_address_is_known() -> None:
    f = agent_net.learn({"toward": "", "token": "t", "listen": True, "master": False}, 0)

    class Req:
        def __init__(self) -> None:
            self.args = {"bound": 3.0, "targets": [
                {"addr": "127.0.0.1", "port": f["port"], "token": "t", "group": "m"},
                {"addr": "127.0.0.1", "port": 1, "token": "t", "group": "r"}]}
    try:
        t0 = time.monotonic()
        got = agent_net.run_probe(Req())   # type: ignore[arg-type]
        assert time.monotonic() - t0 < 1
    finally:
        agent_net.run_close(None)   # type: ignore[arg-type]
    assert [r["ok"] for r in got["results"]] == [True, False]
    assert got["results"][1]["why"] == "refused"
    left = subprocess.run(["ss", "-Htln", f"( sport = :{f['port']} )"], capture_output=True,
                          text=True).stdout
    assert not left.strip(), left


def test_a_stalled_rendezvous_names_the_hosts_that_have_not_joined(tmp_path: Path) -> None:
    from orchestrator.watch import netwatch
    c = parse(BASE.replace("  - 10.0.0.8\n  - 10.0.0.9\n", "  - gpu[01-04]\n"),
              tmp_path / "cluster.yaml")
    assert netwatch.stalled(c, {0, 1, 2, 3}, "10.1.0.5", 29500, 60) is None
    some = netwatch.stalled(c, {0, 1}, "10.1.0.5", 29500, 60)
    assert some is not None and some.startswith(
        "rendezvous: gpu[03-04] have not joined torchrun's rendezvous at 10.1.0.5:29500 "
        "60 s after the launch; likely cause:"), some
    assert "gpu[03-04]" in some and "10.1.0.5:29500 60 s after the launch" in some, some
    assert "cannot reach it (a firewall on the master port" in some
    none = netwatch.stalled(c, set(), "10.1.0.5", 29500, 60)
    assert none is not None and none.startswith("rendezvous: no host has joined"), none


def test_a_candidate_left_unfinished_is_probed_again_where_it_was_left(tmp_path: Path) -> None:
    """Host 0 reaches its inventory address (its own) and stops there; the others reach
    only its eth0: eth0 is probed again on host 0 alone, and chosen."""
    c = cluster(tmp_path)

    def r(addr: str, ok: bool, why: str = "") -> Probed:
        return Probed(addr, 29450, "t", "m", ok, why, addr, 0.0, 3.0)
    results = {0: [r("10.0.0.8", True), r("10.1.0.5", False, "unfinished")],
               1: [r("10.0.0.8", False, "unreachable"), r("10.1.0.5", True)]}
    plan = {i: [Target(x.addr, x.port, x.token, x.group) for x in rs]
            for i, rs in results.items()}
    asked: list[Any] = []

    class Link:
        def request(self, command: str, timeout: float, **fields: Any) -> dict[str, Any]:
            asked.append(fields["targets"])
            return {"results": [{"ok": True, "why": "", "src": "10.1.0.5", "ms": 0.1}]}
    netprobe.settle(c, {0: Link(), 1: Link()},  # type: ignore[dict-item]
                   ["10.0.0.8", "10.1.0.5"], plan, results)
    assert [[t["addr"] for t in a] for a in asked] == [["10.1.0.5"]]
    assert netprobe.choose_master(c, ["10.0.0.8", "10.1.0.5"], results) == "10.1.0.5"


class RetryLink:
    """A host's agent for the probe's second try: each target answers as `answer` says."""

    def __init__(self, asked: list[Any], answer: dict[str, Any]) -> None:
        self.asked, self.answer = asked, answer

    def request(self, command: str, timeout: float, **fields: Any) -> dict[str, Any]:
        self.asked.append((fields["bound"], [(t["addr"], t["group"]) for t in fields["targets"]]))
        return {"results": [dict(self.answer, src="10.1.0.9", ms=1.0) for _ in fields["targets"]]}


def probed(addr: str, group: str, ok: bool, why: str = "", port: int = 29450) -> Probed:
    return Probed(addr, port, "t", group, ok, why, "", 1.0, 3.0)


def test_a_probe_without_an_answer_in_time_is_tried_again_with_a_longer_bound(
        tmp_path: Path) -> None:
    """200 namespace hosts on one loaded kernel: host 0 answered a sixth of them after
    the bound. Those are probed once more, alone, with twice the bound; refused stands."""
    c = cluster(tmp_path, hosts="  - 10.0.0.8\n  - 10.0.0.9\n  - 10.0.0.10\n  - 10.0.0.11\n")
    results = {i: [probed("10.1.0.5", "m", i != 2, "" if i != 2 else "timeout"),
                   probed(f"10.1.0.{6 + (i + 1) % 4}", "r", i != 1, "timeout", 40000)]
               for i in range(4)}
    results[3][1] = probed("10.1.0.6", "r", False, "refused", 40000)
    asked: list[Any] = []
    links = {i: RetryLink(asked, {"ok": True, "why": ""}) for i in range(4)}
    netprobe.retry_slow(c, links, ["10.1.0.5"], results)  # type: ignore[arg-type]
    assert sorted(asked) == [(6.0, [("10.1.0.5", "m0")]), (6.0, [("10.1.0.8", "r0")])], asked
    assert netprobe.choose_master(c, ["10.1.0.5"], results) == "10.1.0.5"
    assert results[1][1].ok and results[1][1].first == 3.0
    assert results[3][1].why == "refused"   # an answer: not tried again
    # tried again and still no answer: said with both bounds
    results = {i: [probed("10.1.0.5", "m", i != 2, "" if i != 2 else "timeout")] for i in range(4)}
    links = {i: RetryLink(asked, {"ok": False, "why": "timeout"}) for i in range(4)}
    netprobe.retry_slow(c, links, ["10.1.0.5"], results)  # type: ignore[arg-type]
    with pytest.raises(HostError) as err:
        netprobe.choose_master(c, ["10.1.0.5"], results)
    assert "10.1.0.5:29450 no answer in 3 s, nor in 6 s once more (a firewall drops it)" \
        in err.value.message, err.value.message


def test_when_every_probe_of_a_kind_timed_out_none_is_tried_again(tmp_path: Path) -> None:
    """A firewall's pattern: every host but host 0 without an answer from host 0, or
    every ring pair: the error comes at once, a bound sooner."""
    c = cluster(tmp_path, hosts="  - 10.0.0.8\n  - 10.0.0.9\n  - 10.0.0.10\n")
    star = {i: [probed("10.1.0.5", "m", i == 0, "" if i == 0 else "timeout")] for i in range(3)}
    # each neighbour's other address (the inventory's) has no route from the others
    ring = {i: [probed("10.1.0.5", "m", True), probed(f"10.1.0.{5 + (i + 1) % 3}", "r", False,
                                                      "timeout", 40000),
                probed(f"10.0.0.{8 + (i + 1) % 3}", "r", False, "unreachable", 40000)]
            for i in range(3)}
    asked: list[Any] = []
    links = {i: RetryLink(asked, {"ok": True, "why": ""}) for i in range(3)}
    for results in (star, ring):
        netprobe.retry_slow(c, links, ["10.1.0.5"], results)  # type: ignore[arg-type]
    assert asked == []
    with pytest.raises(HostError, match=r"no answer in 3 s \(a firewall drops it\)"):
        netprobe.check_ring(c, ring, {i: f"10.1.0.{5 + i}" for i in range(3)})


def test_many_blocked_pairs_with_one_cause_are_one_message(tmp_path: Path) -> None:
    c = parse(BASE.replace("  - 10.0.0.8\n  - 10.0.0.9\n", "  - gpu[01-12]\n"),
              tmp_path / "cluster.yaml")
    results = {i: [Probed(f"10.1.0.{(i + 1) % 12}", 40000, "", "r", False, "timeout",
                          "", 0.0, 3.0)]
               for i in range(12)}
    with pytest.raises(HostError) as err:
        netprobe.check_ring(c, results, {i: f"10.1.0.{i}" for i in range(12)}, 3.04)
    msg = err.value.message
    assert msg.startswith("the network check before launch (3.0 s): 12 of 12 hosts cannot reach their "
                          "ring neighbour on a port the OS picked"), msg
    assert "no answer in 3 s (a firewall drops it): gpu01 -> gpu02 10.1.0.1:40000; " in msg, msg
    assert msg.endswith("(and 8 more)"), msg
    assert "allow TCP between the hosts of the job" in err.value.hint


def test_a_master_port_in_time_wait_is_free_and_a_listened_one_is_not() -> None:
    """A job that just ended leaves TIME_WAIT on its master port (the store closed
    first); torchrun's store binds with SO_REUSEADDR, and so does preflight's check."""
    import socket

    from orchestrator.agent.preflight import port_free
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torchrun's store
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    assert not port_free(port)          # listened on
    server.close()
    conn.close()                        # the server's side closes first: its TIME_WAIT
    client.close()
    assert port_free(port)


# ---------------------------------------------------------------- after the launch

WAITER = """\
import socket, sys, time
port = int(sys.argv[1])
socks = []
for _ in range(3):   # the listener's backlog holds one: the others' SYNs are dropped
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    socks.append(s)
time.sleep(60)
"""


@pytest.mark.parametrize("source", ["sock_diag", "proc"])
def test_the_agent_names_a_rank_connection_that_gets_no_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """A rank whose SYN is dropped (here: a listener whose backlog is full, as a firewall
    that drops it) is SYN_SENT with its SYN sent again: `net_waits` names it with its
    rank, the address and the port; a process of another job is not looked at. The
    kernel's sock_diag answers, or /proc/net/tcp where it cannot; either way the
    namespace the job's two processes share is looked at once a look."""
    import os
    import socket
    import sys

    from orchestrator.agent import sockdiag
    real, looks = sockdiag.sockets, []

    def counted(state: int) -> list[sockdiag.Socket] | None:
        looks.append(state)
        return real(state) if source == "sock_diag" else None
    monkeypatch.setattr(sockdiag, "sockets", counted)
    job = tmp_path / "job"
    (job / "run").mkdir(parents=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    env = dict(os.environ, ORCH_JOB_DIR=str(job), RANK="3")
    other = dict(env, ORCH_JOB_DIR=str(tmp_path / "other"), RANK="5")
    # a process of the job without a rank (its torchrun), started first: each process
    # of the job reads the same /proc/net/tcp, and the owner of a socket is named
    torchrun = {k: v for k, v in env.items() if k != "RANK"}
    procs = [subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket(); "
                               "print(1, flush=True); time.sleep(60)"], env=torchrun,
                              stdout=subprocess.PIPE)]
    assert procs[0].stdout is not None and procs[0].stdout.readline()   # it holds a socket
    procs += [subprocess.Popen([sys.executable, "-c", WAITER, str(port)], env=e)
              for e in (env, other)]

    req = SimpleNamespace(args={"job_dir": str(job)})
    got: list[dict[str, Any]] = []
    asked = 0
    try:
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.3)
            got = agent_net.run_waits(req)["waits"]   # type: ignore[arg-type]
            asked += 1
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        listener.close()
    assert got and {w["rank"] for w in got} == {3}, got
    assert {(w["addr"], w["port"], w["pid"]) for w in got} == {("127.0.0.1", port, procs[1].pid)}
    assert all(w["tries"] >= 1 for w in got), got
    assert all(p.poll() is not None for p in procs)
    assert looks == [sockdiag.TCP_SYN_SENT] * asked   # one per look, not one per process


def test_sock_diag_names_the_same_waiting_connections_as_proc() -> None:
    """IPv4 and IPv6 connections whose SYNs are dropped (listeners with a full backlog),
    among 400 open ones: the kernel's sock_diag answer is /proc/net/tcp{,6}'s, field by
    field (inode, local and remote address, port, the SYN's tries); a truncated or short
    netlink answer is cut off, not misread."""
    import os
    import socket

    from orchestrator.agent import sockdiag
    held: list[socket.socket] = []
    try:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(256)
        held.append(server)
        for _ in range(200):
            held.append(socket.create_connection(server.getsockname()))
            held.append(server.accept()[0])
        families = [(socket.AF_INET, "127.0.0.1")]
        if socket.has_ipv6:
            families.append((socket.AF_INET6, "::1"))
        for family, addr in families:
            full = socket.socket(family)
            try:
                full.bind((addr, 0))
            except OSError:
                continue
            full.listen(0)
            held.append(full)
            for _ in range(3):
                s = socket.socket(family)
                s.setblocking(False)
                s.connect_ex((addr, full.getsockname()[1]))
                held.append(s)
        owner = dict.fromkeys(agent_net.socket_inodes(os.getpid()), os.getpid())
        deadline, fields = time.monotonic() + 10, ("inode", "local", "addr", "port", "tries")
        diag: list[tuple[Any, ...]] = []
        proc: list[tuple[Any, ...]] = [()]
        while time.monotonic() < deadline and (not diag or diag != proc):
            time.sleep(0.3)   # the first SYN is sent again after a second
            diag = sorted(tuple(w[k] for k in fields) for w in agent_net.own_syn_sent(owner) or [])
            proc = sorted(tuple(w[k] for k in fields)
                          for w in agent_net.proc_syn_sent(os.getpid(), owner))
        assert diag and diag == proc, (diag, proc)
        assert len(diag) >= 2 and {d[2] for d in diag} <= {"127.0.0.1", "::1"}, diag
    finally:
        for s in held:
            s.close()
    head = sockdiag._HDR.pack(16 + 8, 20, 0, 1, 0) + b"\0" * 8
    assert sockdiag.messages(head + head[:10]) == [(20, b"\0" * 8)]   # the cut one dropped
    assert sockdiag.parse(b"\0" * 8) is None


def test_proc_net_addresses_are_decoded() -> None:
    assert agent_net.hex_addr("0100007F:1F90") == ("127.0.0.1", 8080)
    assert agent_net.hex_addr("0000000000000000FFFF00000200630A:B26F") == ("10.99.0.2", 45679)
    assert agent_net.hex_addr("00000000000000000000000001000000:0016") == ("::1", 22)


def test_network_hang_looks_thin_out() -> None:
    from itertools import islice

    from orchestrator.watch.netwatch import looks
    assert list(islice(looks(60), 6)) == [10, 20, 40, 60, 120, 240]
    assert list(islice(looks(4), 3)) == [4, 8, 16]


def test_a_network_hang_is_said_with_the_host_pair(tmp_path: Path) -> None:
    """Host 1's rank 1 waits for host 2's 10.1.0.7 on a port the OS picked (a firewall
    drops it): said once, naming both hosts, the address, the cause and the fix; a
    rendezvous wait of a torchrun toward the master port names that port as the fix."""
    from orchestrator.watch import events as ev
    from orchestrator.watch.netwatch import NetWatch
    c = cluster(tmp_path, hosts="  - 10.0.0.8\n  - 10.0.0.9\n  - 10.0.0.10\n")
    lans = ["10.1.0.5", "10.1.0.6", "10.1.0.7"]
    waits: dict[int, list[dict[str, Any]]] = {0: [], 2: [],
        1: [{"rank": 1, "pid": 9, "local": "10.1.0.6", "addr": "10.1.0.7", "port": 41234,
             "tries": 3},
            {"rank": 1, "pid": 9, "local": "127.0.0.1", "addr": "127.0.0.1", "port": 5,
             "tries": 3}]}

    class Link:
        def __init__(self, i: int) -> None:
            self.i = i

        def request(self, command: str, timeout: float, **fields: Any) -> dict[str, Any]:
            assert command == "net_waits" and fields == {"job_dir": "/j"}
            return {"waits": waits[self.i], "interfaces": [
                {"name": "eth0", "addrs": [lans[self.i]], "up": True},
                {"name": "docker0", "addrs": ["172.17.0.1"], "up": True}]}
    session = SimpleNamespace(cluster=c, links={i: Link(i) for i in range(3)},
                              records={i: SimpleNamespace(job_dir="/j") for i in range(3)})
    said: list[ev.Event] = []
    watch = NetWatch(session, {0, 1, 2}, lambda: False, said.append,  # type: ignore[arg-type]
                     ("10.1.0.5", 29500))
    watch.look(10, rendezvous=False)
    watch.look(20, rendezvous=False)   # said once
    assert len(said) == 1 and isinstance(said[0], ev.NetworkStall), said
    e = said[0]
    assert e.waits == (ev.NetWait("10.0.0.9", 1, "10.0.0.10", "10.1.0.7", 41234, 3),)
    assert e.text.startswith("network hang: 1 host pair gets no answer to a connection (rank 1 "
                             "on 10.0.0.9 -> 10.0.0.10 at 10.1.0.7:41234, 4 tries unanswered); "
                             "likely cause: a firewall between 10.0.0.[9-10] drops it"), e.text
    assert "allow TCP between the hosts of the job on every port" in e.text, e.text
    waits[1] = [{"rank": None, "pid": 8, "local": "10.1.0.6", "addr": "10.1.0.5",
                 "port": 29500, "tries": 2}]
    late = NetWatch(session, {0}, lambda: False, said.append,  # type: ignore[arg-type]
                    ("10.1.0.5", 29500))
    late.look(60, rendezvous=True)
    text = said[-1].text   # type: ignore[attr-defined]
    assert text.startswith("network hang: 1 host pair gets no answer to a connection "
                           "(torchrun on 10.0.0.9 -> 10.0.0.8 at 10.1.0.5:29500 (the "
                           "rendezvous), 3 tries unanswered)"), text
    assert "fix: allow TCP port 29500 from the other hosts to host 0" in text, text
    assert said[-1].late == ("10.0.0.9", "10.0.0.10")   # type: ignore[attr-defined]
    waits[1] = []   # no waiting connection: the rendezvous line guesses the cause
    NetWatch(session, {0}, lambda: False, said.append,  # type: ignore[arg-type]
             ("10.1.0.5", 29500)).look(60, rendezvous=True)
    assert said[-1].text.startswith(  # type: ignore[attr-defined]
        "rendezvous: 10.0.0.[9-10] have not joined"), said[-1]
