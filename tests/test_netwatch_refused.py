"""A connection between the hosts that fails at once (a firewall that refuses, no
route): gloo gives up on a pair in about a second and init_process_group raises, so the
root cause's last lines name it; watch/netwatch.refused names the network as the cause.
Controller side on fake replies; the e2e is in test_e2e_network.py."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from orchestrator.config.inventory import parse
from orchestrator.watch import events as ev
from orchestrator.watch.netwatch import connect_error, refused

GLOO = ("RuntimeError: Gloo connectFullMesh failed with [/pytorch/third_party/gloo/gloo/"
        "transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
        "remote=[10.1.0.7]:62345$2")
NCCL = "h1:77:90 [0] misc/socket.c:484 NCCL WARN socketStartConnect: Connect to " \
       "10.1.0.7<43215> failed : No route to host"
STORE = ("torch.distributed.DistNetworkError: The client socket has failed to connect to "
         "[h0]:29500 (errno: 111 - Connection refused).")
LANS = ["10.1.0.5", "10.1.0.6", "10.1.0.7"]
MASTER = ("10.1.0.5", 29500)


def session(tmp_path: Path, hosts: int = 3, broken: int | None = None) -> Any:
    names = "".join(f"  - 10.0.{(8 + i) // 256}.{(8 + i) % 256}\n" for i in range(hosts))
    c = parse(f"name: n\nhosts:\n{names}job: {{entrypoint: job.py}}\n",
              tmp_path / "cluster.yaml")
    asked: list[int] = []

    class Link:
        def __init__(self, i: int) -> None:
            self.i = i

        def request(self, command: str, timeout: float, **fields: Any) -> dict[str, Any]:
            assert command == "net_waits" and fields == {"job_dir": "/j"}
            asked.append(self.i)
            if self.i == broken:
                raise OSError("connection lost")
            return {"waits": [], "interfaces": [
                {"name": "eth0", "addrs": [LANS[self.i]], "up": True},
                {"name": "docker0", "addrs": ["172.17.0.1"], "up": True}]}
    return SimpleNamespace(cluster=c, links={i: Link(i) for i in range(hosts)}, asked=asked,
                           records={i: SimpleNamespace(job_dir="/j") for i in range(hosts)})


def cause(*lines: str, rank: int = 2, host: str = "10.0.0.10") -> ev.RootCause:
    return ev.RootCause(0.0, "rank", (ev.RankFailure(rank, host, 0, 1, last_lines=lines),))


def test_the_failed_connection_is_read_in_gloo_nccl_and_store_words() -> None:
    assert connect_error((GLOO,)) == ("10.1.0.7", 62345, "refused")
    assert connect_error((NCCL,)) == ("10.1.0.7", 43215, "unreachable")
    assert connect_error((STORE,)) == ("h0", 29500, "refused")
    # the last such line counts; a line with no connection, or a port past 65535, none
    assert connect_error((NCCL, "noise", GLOO, "more noise")) == ("10.1.0.7", 62345, "refused")
    assert connect_error(("RuntimeError: CUDA out of memory", "Connection refused")) is None
    assert connect_error(("SO_ERROR: Connection refused, remote=[10.1.0.7]:99999",)) is None


def test_a_refused_pair_is_named_as_the_root_cause_with_the_fix(tmp_path: Path) -> None:
    """Rank 2 on host 10.0.0.10 is refused by 10.1.0.5 (host 0's eth0, the address the
    hosts use between themselves) on a port the OS picked for gloo's pair."""
    s = session(tmp_path)
    line = GLOO.replace("10.1.0.7", "10.1.0.5")
    e = refused(s, cause("Traceback (most recent call last):", line), MASTER)
    assert isinstance(e, ev.NetworkStall) and e.late == ()
    assert e.waits == (ev.NetWait("10.0.0.10", 2, "10.0.0.8", "10.1.0.5", 62345, 0,
                                  "refused"),)
    assert e.text == (
        "the root cause is the network: rank 2 on 10.0.0.10 could not connect to 10.0.0.8 "
        "at 10.1.0.5:62345 (refused); likely cause: a firewall on 10.0.0.8 refuses (REJECT) "
        "that port; fix: allow TCP between the hosts of the job on every port (gloo and "
        "NCCL connect each pair of ranks on a port the OS picks, not only the master port)")
    assert sorted(s.asked) == [0, 1, 2]   # one question per host, only now


def test_the_master_port_a_loopback_and_no_route_each_get_their_fix(tmp_path: Path) -> None:
    s = session(tmp_path)
    store = refused(s, cause(STORE.replace("[h0]", "[10.1.0.5]"), rank=1, host="10.0.0.9"),
                    MASTER)
    assert store is not None and "could not connect to 10.0.0.8 at 10.1.0.5:29500 (the " \
        "rendezvous) (refused)" in store.text, store
    assert store.text.endswith("fix: allow TCP port 29500 from the other hosts to host 0")
    trap = refused(s, cause(GLOO.replace("10.1.0.7", "127.0.1.1")), MASTER)
    assert trap is not None and "could not connect to a loopback address at " \
        "127.0.1.1:62345 (refused); likely cause: a rank told the others a loopback " \
        "address" in trap.text, trap
    assert "set `network.interface` in cluster.yaml" in trap.text
    route = refused(s, cause(NCCL), MASTER)
    assert route is not None and "to 10.0.0.10 at 10.1.0.7:43215 (unreachable); likely " \
        "cause: no route from 10.0.0.10 to 10.1.0.7" in route.text, route


def test_an_address_several_hosts_hold_or_none_answers_names_no_peer(tmp_path: Path) -> None:
    """docker0's 172.17.0.1 is every host's: no peer is guessed. A host that does not
    answer is left out; the address is still named, with the cause and fix."""
    s = session(tmp_path, broken=2)
    e = refused(s, cause(GLOO.replace("10.1.0.7", "172.17.0.1")), MASTER)
    assert e is not None and e.waits[0].peer is None
    assert "could not connect to another host at 172.17.0.1:62345 (refused)" in e.text, e
    lost = refused(s, cause(GLOO), MASTER)   # host 2's 10.1.0.7: host 2 did not answer
    assert lost is not None and "could not connect to another host at 10.1.0.7" in lost.text


def test_nothing_is_said_without_a_connection_error_or_on_one_host(tmp_path: Path) -> None:
    s = session(tmp_path)
    assert refused(s, cause("RuntimeError: CUDA out of memory"), MASTER) is None
    assert refused(s, ev.RootCause(0.0, "silent", silent=("10.0.0.9",)), MASTER) is None
    assert refused(session(tmp_path, hosts=1), cause(GLOO), MASTER) is None
    assert s.asked == []   # the hosts are asked only when a connection failed


# ---------------------------------------------- refused, and tried again: the check

class Fleet:
    """Fake links: each host's failed connects (`fails`), which ports refuse (`refuse`:
    (from, to) pairs), and every request asked, in order."""

    def __init__(self, tmp_path: Path, hosts: int) -> None:
        self.s = session(tmp_path, hosts)
        self.s.run_id = "r1"
        self.fails = dict.fromkeys(range(hosts), 100)
        self.refuse: set[tuple[int, int]] = set()
        self.asked: list[tuple[str, int, Any]] = []
        self.s.links = {i: self.link(i) for i in range(hosts)}
        self.started = set(range(hosts))   # each host's one rank

    def link(self, i: int) -> Any:
        fleet = self

        class Link:
            def request(self, command: str, timeout: float, **f: Any) -> dict[str, Any]:
                fleet.asked.append((command, i, f))
                if command == "net_waits":
                    return {"waits": [], "fails": fleet.fails[i], "interfaces": [
                        {"name": "eth0", "addrs": [f"10.1.0.{5 + i}"], "up": True}]}
                if command == "net_listen":
                    return {"port": 40000 + i}
                if command == "net_probe":
                    return {"results": [
                        {"ok": (i, int(t["group"])) not in fleet.refuse, "src": "",
                         "why": "refused" if (i, int(t["group"])) in fleet.refuse else "",
                         "ms": 1.0} for t in f["targets"]]}
                assert command == "net_close", command
                return {"closed": 1}
        return Link()

    def watch(self) -> tuple[Any, list[ev.Event]]:
        from orchestrator.watch.netwatch import NetWatch
        said: list[ev.Event] = []
        return NetWatch(self.s, self.started, lambda: False, said.append,
                        ("10.1.0.5", 29500)), said


def test_refused_connects_tried_again_are_checked_and_the_pair_named(tmp_path: Path) -> None:
    """No connection waits, but host 1's failed connects grow between two looks: host 1
    checks the other hosts on a port the OS picks (each listens once, then closes), and
    the refused pair is named with the cause and fix; said once."""
    fleet = Fleet(tmp_path, 3)
    fleet.refuse = {(1, 0)}
    watch, said = fleet.watch()
    watch.look(10, rendezvous=False)   # where each count starts: nothing said
    assert said == [] and {c for c, _, _ in fleet.asked} == {"net_waits"}
    fleet.fails[1] += 7
    watch.look(20, rendezvous=False)
    assert len(said) == 1 and isinstance(said[0], ev.NetworkStall), said
    e = said[0]
    assert e.waits == (ev.NetWait("10.0.0.9", None, "10.0.0.8", "10.1.0.5", 40000, 0,
                                  "refused"),)
    assert e.text.startswith(
        "network hang: failed TCP connects, more at each look: 7 on 10.0.0.9 (refused or "
        "unreachable, then tried again, so no connection waits); checked on a port the OS "
        "picks: 1 host pair cannot connect (10.0.0.9 -> 10.0.0.8 at 10.1.0.5:40000 "
        "refused); likely cause: a firewall between 10.0.0.[8-9] refuses it; fix: allow "
        "TCP between the hosts of the job on every port"), e.text
    probes = [(i, f) for c, i, f in fleet.asked if c == "net_probe"]
    assert [i for i, _ in probes] == [1]
    assert [t["group"] for t in probes[0][1]["targets"]] == ["2", "0"]   # the ring on
    listened = sorted(i for c, i, _ in fleet.asked if c == "net_listen")
    assert listened == sorted(i for c, i, _ in fleet.asked if c == "net_close") == [0, 2]
    fleet.fails[1] += 7
    watch.look(40, rendezvous=False)
    assert len(said) == 1   # said once


def test_few_failed_connects_ask_nothing_and_a_clean_check_invents_no_pair(
        tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, 3)
    watch, said = fleet.watch()
    watch.look(10, rendezvous=False)
    fleet.fails[2] += 2   # below MIN_FAILS: another process's, or a peer not yet up
    watch.look(20, rendezvous=False)
    assert said == [] and "net_probe" not in {c for c, _, _ in fleet.asked}
    watch.look(30, rendezvous=False)   # no growth: the run of looks ends
    fleet.fails[2] += 2
    watch.look(40, rendezvous=False)
    assert said == [] and "net_probe" not in {c for c, _, _ in fleet.asked}
    fleet.fails[2] += 5
    watch.look(80, rendezvous=False)
    text = said[0].text   # type: ignore[attr-defined]
    assert text.startswith("network: failed TCP connects, more at each look: 7 on "
                           "10.0.0.10 (refused or unreachable"), text
    assert "the cause is not found" in text and "->" not in text, text
    assert said[0].waits == ()   # type: ignore[attr-defined]


def test_a_store_refused_with_a_growing_backoff_is_named_over_several_looks(
        tmp_path: Path) -> None:
    """torch's store client tries again with a growing backoff: measured at a store
    refused at host 0, two refusals between looks at 4, 8, 16, 32 and 64 s. No single
    gap reaches MIN_FAILS, the run of looks does (the end-to-end test of a refused store
    missed it in half of its runs when the count was of one gap)."""
    fleet = Fleet(tmp_path, 3)
    fleet.refuse = {(1, 0)}
    watch, said = fleet.watch()
    watch.look(4, rendezvous=True)
    fleet.fails[1] += 2
    watch.look(8, rendezvous=False)
    assert said == [] and "net_probe" not in {c for c, _, _ in fleet.asked}
    fleet.fails[1] += 2
    watch.look(16, rendezvous=False)
    assert len(said) == 1, said
    assert said[0].text.startswith(   # type: ignore[attr-defined]
        "network hang: failed TCP connects, more at each look: 4 on 10.0.0.9"), said[0]
    assert "10.0.0.9 -> 10.0.0.8 at 10.1.0.5:40000 refused" in said[0].text   # type: ignore[attr-defined]


def test_a_cause_not_found_is_said_once_and_a_later_refusal_is_still_named(
        tmp_path: Path) -> None:
    """At the rendezvous look a node was refused while host 0 still started (every host
    answers the check: no cause); the firewall comes later: the looks go on and name it.
    CI, beside a CPU burner, saw the first line and then nothing for 25 minutes."""
    fleet = Fleet(tmp_path, 3)
    watch, said = fleet.watch()
    watch.look(4, rendezvous=False)
    fleet.fails[1] += 13
    watch.look(8, rendezvous=True)
    assert len(said) == 1 and "the cause is not found" in said[0].text   # type: ignore[attr-defined]
    fleet.fails[1] += 5                # the same again: not said twice
    watch.look(16, rendezvous=False)
    assert len(said) == 1, said
    fleet.refuse = {(1, 0)}            # now a firewall on host 0 refuses host 1
    fleet.fails[1] += 9
    watch.look(32, rendezvous=False)
    assert len(said) == 2, said
    assert said[1].text.startswith("network hang: failed TCP connects, more at each look: "   # type: ignore[attr-defined]
                                   "9 on 10.0.0.9"), said[1]
    assert "10.0.0.9 -> 10.0.0.8 at 10.1.0.5:40000 refused" in said[1].text   # type: ignore[attr-defined]
    fleet.fails[1] += 9
    fleet.asked.clear()
    watch.look(64, rendezvous=False)   # a cause named: no more asking
    assert len(said) == 2 and fleet.asked == []


def test_failed_connects_before_the_ranks_start_are_no_fault_until_the_rendezvous_look(
        tmp_path: Path) -> None:
    """A node's launcher is refused by the store while host 0 still imports torch: its
    count grows before its ranks start. Counted only between looks that found the host's
    ranks started, or at the rendezvous look for a host none of whose ranks started."""
    fleet = Fleet(tmp_path, 3)
    fleet.started.clear()
    watch, said = fleet.watch()
    watch.look(4, rendezvous=False)
    fleet.fails[1] += 9
    watch.look(8, rendezvous=False)
    assert said == [], said
    fleet.started.update({0, 1, 2})   # started: this look only sets where counts start
    fleet.fails[1] += 9
    watch.look(16, rendezvous=False)
    assert said == [], said
    fleet.fails[1] += 9
    watch.look(32, rendezvous=False)
    assert len(said) == 1 and "9 on 10.0.0.9" in said[0].text   # type: ignore[attr-defined]
    late = Fleet(tmp_path, 3)
    late.started.clear()
    late.started.add(0)
    watch, said = late.watch()
    watch.look(40, rendezvous=False)
    late.fails[2] += 4
    watch.look(60, rendezvous=True)   # host 2 has not joined: its refusals count now
    assert len(said) == 1 and "4 on 10.0.0.10" in said[0].text, said   # type: ignore[attr-defined]
    assert "rendezvous: 10.0.0.[9-10] have not joined" in said[0].text   # type: ignore[attr-defined]


def test_the_check_stays_bounded_at_a_thousand_hosts(tmp_path: Path) -> None:
    """Every host's count grows: REACH_FROM hosts check REACH_PEERS each, no more."""
    from orchestrator.watch.netwatch import REACH_FROM, REACH_PEERS
    fleet = Fleet(tmp_path, 1000)
    watch, said = fleet.watch()
    watch.look(10, rendezvous=False)
    for i in fleet.fails:
        fleet.fails[i] += 10
    fleet.asked.clear()
    watch.look(20, rendezvous=False)
    probes = [f for c, _, f in fleet.asked if c == "net_probe"]
    assert len(probes) == REACH_FROM and all(len(f["targets"]) == REACH_PEERS for f in probes)
    assert len([c for c, _, _ in fleet.asked if c == "net_listen"]) <= REACH_FROM * REACH_PEERS
    assert "and 996 more hosts" in said[0].text   # type: ignore[attr-defined]


# ------------------------------------------------------------ the agent's count

def test_the_agent_reads_the_kernels_failed_connects(tmp_path: Path) -> None:
    """Tcp: AttemptFails of /proc/<pid>/net/snmp, once per network namespace; a refused
    connect here counts (the counter only grows: other processes cannot break that)."""
    import os
    import socket

    from orchestrator.agent import network as agent_net
    snmp = tmp_path / "snmp"
    snmp.write_text("Ip: Forwarding DefaultTTL\nIp: 1 64\nTcp: RtoAlgorithm ActiveOpens "
                    "AttemptFails\nTcp: 1 20 17\nUdp: InDatagrams\nUdp: 5\n")
    assert agent_net.snmp_attempt_fails(str(snmp)) == 17
    snmp.write_text("Tcp: RtoAlgorithm\nTcp: 1\n")
    assert agent_net.snmp_attempt_fails(str(snmp)) is None
    assert agent_net.snmp_attempt_fails(str(tmp_path / "none")) is None
    me = os.getpid()
    before = agent_net.attempt_fails([me, me, os.getppid()])   # one namespace: once
    assert before == agent_net.snmp_attempt_fails(f"/proc/{me}/net/snmp")
    assert isinstance(before, int)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))   # bound, not listening: a connect to it is refused
    port = closed.getsockname()[1]
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            pass
    closed.close()
    after = agent_net.attempt_fails([me])
    assert after is not None and after >= before + 1, (before, after)
    assert agent_net.attempt_fails([2 ** 22 + 7]) is None   # no such process


def test_a_cause_not_found_is_not_said_while_the_job_prints(tmp_path: Path) -> None:
    """The count is the whole host's: another program's refused connects grow it while
    the job trains (the shipped demo said "the cause is not found" between two epochs
    beside a busy machine). While a rank printed since the last look, a check that finds
    every host answering says nothing; once the job is quiet, the same is said. A pair
    found is said whether the job prints or not (the ranks' own warnings are lines)."""
    from orchestrator.watch.netwatch import NetWatch
    fleet = Fleet(tmp_path, 3)
    printed = [True]
    said: list[ev.Event] = []
    watch = NetWatch(fleet.s, fleet.started, lambda: False, said.append, ("10.1.0.5", 29500),
                     lambda since: printed[0])
    watch.look(10, rendezvous=False)
    for at in (20, 40):
        fleet.fails[1] += 7
        watch.look(at, rendezvous=at == 40)   # the rendezvous look: every host joined
    assert [e for e in said if "failed TCP" in e.text] == [], said   # type: ignore[attr-defined]
    printed[0] = False
    fleet.fails[1] += 7
    watch.look(80, rendezvous=False)
    assert len(said) == 1 and "the cause is not found" in said[0].text, said   # type: ignore[attr-defined]
    printed[0] = True
    fleet.refuse = {(1, 0)}
    fleet.fails[1] += 7
    watch.look(160, rendezvous=False)
    assert len(said) == 2 and "10.0.0.9 -> 10.0.0.8" in said[1].text, said   # type: ignore[attr-defined]
