"""orch at 300 hosts (the `scale` tier: `make test-scale`, which CI runs after `make test`;
not in the default run): one sshd per address past one /24 (the benchmark's bed,
bench/common.py), the plain login user (/bin/sh: root's shell here runs `pyenv init`, 0.2 s
of CPU per session, which at 300 hosts is minutes of this machine's 2 cores and is
bench/fleet.py's to measure), a stand-in torchrun (its rendezvous at the master, no torch
import), the controller under a login session's soft limit of 1,024 open files.

`orch up` preflights, pushes, launches, prints every rank's line exactly once and ends
well; `orch status` answers for every host; `orch stop` of a running job leaves nothing;
and the controller never held more than 1,024 descriptors (it runs under that limit).
"""
from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from common import ORCH, Bed, Beds, bed_cluster, orch_env, remote_base  # noqa: E402

HOSTS = 300
NOFILE = 1024
HELLO = 'import os\nprint("scale-ok rank=%s" % os.environ["RANK"], flush=True)\n'
SLEEPER = 'import time\nprint("started", flush=True)\ntime.sleep(600)\n'

pytestmark = pytest.mark.scale


@pytest.fixture(scope="module")
def beds(request: pytest.FixtureRequest) -> Iterator[Beds]:
    if "scale" not in (request.config.option.markexpr or ""):
        pytest.skip("the scale tier runs with -m scale")
    with bed_cluster(HOSTS, ["plain"], wide=True) as made:
        yield made
    assert made.clean, "sshd or job processes of the scale test were left"


def login_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))


def orch(inv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ORCH), *args, "-c", str(inv)], cwd=inv.parent, env=orch_env(),
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                          preexec_fn=login_limit)


def bed_of(beds: Beds, name: str) -> Bed:
    sh = beds.shells["plain"]
    return Bed(beds.cluster, beds.cluster.hosts, sh, beds.python,
               beds.cluster.root.parent / "work" / name,
               remote_base(beds.cluster, sh) / name, ssh={"connect_timeout": 60})


def test_up_at_300_hosts_prints_every_rank_once(beds: Beds) -> None:
    bed = bed_of(beds, "hello")
    inv = bed.inventory("hello", HELLO)
    r = orch(inv, "up")
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = Counter(int(m) for m in re.findall(r"scale-ok rank=(\d+)", r.stdout))
    assert sorted(ranks) == list(range(HOSTS)), f"ranks missing: {set(range(HOSTS)) - set(ranks)}"
    assert set(ranks.values()) == {1}, "a rank's line was printed more than once"
    assert not bed.left_over()


def test_status_and_stop_at_300_hosts(beds: Beds) -> None:
    bed = bed_of(beds, "sleep")
    inv = bed.inventory("sleep", SLEEPER)
    r = orch(inv, "up", "--detach")
    assert r.returncode == 0, r.stderr[-3000:]
    s = orch(inv, "status", "--json")
    assert s.returncode == 0, s.stderr[-3000:]
    doc = json.loads(s.stdout)
    assert not doc["unreachable"], doc["unreachable"]
    assert sorted(r["rank"] for r in doc["ranks"]) == list(range(HOSTS))
    assert {r["state"] for r in doc["ranks"]} == {"running"}, doc["ranks"][:3]
    t = orch(inv, "stop")
    assert t.returncode == 0, t.stderr[-3000:]
    assert not bed.left_over(), "a job process outlived orch stop"
