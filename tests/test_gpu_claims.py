"""GPU claims on one host (agent/gpus.py) against the stand-in nvidia-smi, in process,
and the controller's side of them (session/gpuclaims.py): which GPUs a job takes, who a
busy GPU's holder is, `gpus: all`, the layout that follows, the messages."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpu_standin
from orchestrator.agent import gpus
from orchestrator.config.inventory import load
from orchestrator.errors import InventoryError
from orchestrator.session import gpuclaims


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 4-GPU local host: the stand-in on PATH, claims in a folder of this test's."""
    bin_dir = tmp_path / "bin"
    gpu_standin.install(bin_dir)
    gpu_standin.describe(tmp_path, "local", 4, util=[10, 20, 30, 40], mem_used=[1, 2, 3, 4])
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ORCH_FAKE_GPUS_DIR", str(tmp_path))
    monkeypatch.setenv("ORCH_GPU_CLAIMS_DIR", str(tmp_path / "claims"))
    monkeypatch.delenv("SSH_CONNECTION", raising=False)
    yield tmp_path
    for job in list(gpus.HELD):
        gpus.release(job)


REPO = Path(__file__).resolve().parent.parent
WHO = {"job": "a", "user": "alice", "job_dir": "/x/a", "part": "h"}


def test_two_jobs_get_disjoint_gpus_and_a_third_is_told_who_holds_them(host: Path) -> None:
    a = gpus.claim("/x/a", 2, dict(WHO))
    b = gpus.claim("/x/b", 2, dict(WHO, job="b", user="bob", job_dir="/x/b"))
    assert a["ids"] == [0, 1] and b["ids"] == [2, 3]
    c = gpus.claim("/x/c", 1, dict(WHO, job="c"))
    assert "ids" not in c and "/x/c" not in gpus.HELD
    holders = {g["index"]: g["holder"] for g in c["busy"]}
    assert holders[0]["job"] == "a" and holders[3] == {"job": "b", "user": "bob",
                                                       "job_dir": "/x/b", "part": "h"}
    gpus.release("/x/a")   # the kernel drops the lock with the descriptor
    assert gpus.claim("/x/c", 2, dict(WHO, job="c"))["ids"] == [0, 1]


def test_a_claim_is_all_or_nothing(host: Path) -> None:
    gpus.claim("/x/a", [1], dict(WHO))
    got = gpus.claim("/x/b", [0, 1], dict(WHO, job="b"))
    assert "busy" in got and "/x/b" not in gpus.HELD
    assert gpus.claim("/x/b", [0, 2], dict(WHO, job="b"))["ids"] == [0, 2]   # named ones


def test_a_process_no_claim_covers_makes_its_gpu_busy(host: Path) -> None:
    gpu_standin.describe(host, "local", 4, apps=[{"gpu": 1, "pid": os.getpid(), "mem": 700}])
    got = gpus.claim("/x/a", 4, dict(WHO))
    holder = {g["index"]: g["holder"] for g in got["busy"]}[1]
    assert holder["pids"][0]["pid"] == os.getpid() and holder["pids"][0]["mem"] == 700
    assert "not an orch job" in gpuclaims.holder_text(holder)
    assert gpus.claim("/x/a", "all", dict(WHO))["ids"] == [0, 2, 3]   # every free one


def test_all_takes_every_free_gpu_and_needs_one(host: Path) -> None:
    assert gpus.claim("/x/a", "all", dict(WHO))["ids"] == [0, 1, 2, 3]
    assert "busy" in gpus.claim("/x/b", "all", dict(WHO, job="b"))


def test_survey_gives_facts_and_holders(host: Path) -> None:
    gpus.claim("/x/a", [2], dict(WHO))
    found = gpus.survey()["gpus"]
    assert [(g["index"], g["util"], g["mem_used"], g["mem_total"]) for g in found] == [
        (0, 10.0, 1.0, 81920.0), (1, 20.0, 2.0, 81920.0), (2, 30.0, 3.0, 81920.0),
        (3, 40.0, 4.0, 81920.0)]
    assert [g["holder"] is not None for g in found] == [False, False, True, False]
    assert found[2]["uuid"] == "GPU-fake-local-2"


def test_claims_outlive_the_agent_in_a_forked_child_only_while_it_lives(host: Path) -> None:
    """The supervisor inherits the claim at its fork: the GPU stays held after the
    agent lets go, until the child ends."""
    gpus.claim("/x/a", [0], dict(WHO))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.read(r, 1)   # until the parent says
        os._exit(0)
    os.close(r)
    gpus.release("/x/a")
    assert "busy" in gpus.claim("/x/b", [0], dict(WHO, job="b"))
    os.close(w)
    os.waitpid(child, 0)
    assert gpus.claim("/x/b", [0], dict(WHO, job="b"))["ids"] == [0]


def test_the_claims_folder_is_sticky_and_a_link_there_is_refused(host: Path) -> None:
    folder = Path(gpus.claims_dir())
    assert folder.stat().st_mode & 0o7777 == 0o1777
    (host / "elsewhere").mkdir()
    os.environ["ORCH_GPU_CLAIMS_DIR"] = str(host / "link")
    (host / "link").symlink_to(host / "elsewhere")
    with pytest.raises(gpus.GpuError, match="not a folder"):
        gpus.claims_dir()


def test_nvidia_smi_output_is_parsed_with_caps_and_odd_values() -> None:
    text = "0, GPU-a, Tesla V100, [N/A], 10, 16384\n1, GPU-b, A, B, 5, 6, 7\nnonsense\n"
    got = gpus.parse_gpus(text + "2, GPU-c, X, 1, 2, 3\n" * 1000)
    assert got[0]["util"] is None and got[1]["name"] == "A, B" and len(got) == gpus.MAX_GPUS - 1   # lines are capped
    assert gpus.parse_apps("GPU-a, 12, [N/A]\nGPU-a, x, 1\n") == [
        {"uuid": "GPU-a", "pid": 12, "mem": None}]


def test_no_nvidia_smi_is_one_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(gpus.GpuError, match="nvidia-smi cannot be run"):
        gpus.survey()


def inventory(tmp_path: Path, hosts: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: g\nhosts:\n" + textwrap.indent(textwrap.dedent(hosts), "  ")
                    + "job:\n  entrypoint: job.py\n")
    (tmp_path / "job.py").write_text("")
    return path


def test_gpus_all_counts_at_preflight_and_the_ranks_follow(tmp_path: Path) -> None:
    cluster = load(inventory(tmp_path, """\
        - address: a
          gpus: all
        - address: b
          gpus: 2
        """))
    assert [h.gpu_want for h in cluster.hosts] == ["all", 2]
    run = gpuclaims.apply(cluster, {0: [1, 2, 3], 1: [0, 1]})
    assert [(list(h.ranks), h.gpu_ids) for h in run.hosts] == [([0, 1, 2], (1, 2, 3)),
                                                              ([3, 4], (0, 1))]
    assert run.world_size == 5 and "gpus: all" in run.selection


def test_gpus_all_with_more_procs_than_free_gpus_names_the_line(tmp_path: Path) -> None:
    cluster = load(inventory(tmp_path, """\
        - address: a
          gpus: all
          procs: 3
        """))
    with pytest.raises(InventoryError, match=r"cluster.yaml:3: .*only 2 GPU\(s\) were free"):
        gpuclaims.apply(cluster, {0: [0, 1]})


def test_a_busy_gpu_message_names_holders_and_the_fixes(tmp_path: Path) -> None:
    cluster = load(inventory(tmp_path, "- address: a\n  gpus: 2\n"))
    busy = [{"index": 0, "holder": {"job": "x", "user": "bob"}},
            {"index": 1, "holder": {"pids": [{"pid": 7, "user": "carol"}]}},
            {"index": 2, "holder": None}]
    err = gpuclaims.problem(cluster, cluster.hosts[0], {"gpu_busy": busy})
    assert isinstance(err, gpuclaims.GpusBusy) and err.exit_code == 3
    assert err.message == ("a: 2 GPUs asked for, 1 of 3 free: GPU 0 held by job 'x' (user bob); "
                           "GPU 1 held by pid 7 (user carol), not an orch job")
    assert "--wait" in err.hint and "--exclude a" in err.hint
    few = gpuclaims.problem(cluster, cluster.hosts[0], {"gpu_busy": busy[:1]})
    assert few is not None and not isinstance(few, gpuclaims.GpusBusy)
    assert "1 found" in few.message


def test_a_holder_cannot_write_to_the_terminal() -> None:
    text = gpuclaims.holder_text({"job": "x\x1b]0;owned\x07", "user": "u\nv"})
    assert "\x1b" not in text and "\n" not in text


def test_the_stand_in_answers_like_nvidia_smi(host: Path) -> None:
    out = subprocess.run(["nvidia-smi", *gpus.QUERY_GPU], capture_output=True, text=True)
    assert out.stdout.splitlines()[0] == "0, GPU-fake-local-0, Fake GPU 80GB, 10, 1, 81920"


def test_gpus_per_task_beyond_a_hosts_gpus_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: g\nhosts:\n  - address: a\n    gpus: 1\njob:\n  entrypoint: job.py\n"
                    "  array:\n    tasks: [[x]]\n    gpus_per_task: 2\n")
    (tmp_path / "job.py").write_text("")
    with pytest.raises(InventoryError, match=r"cluster.yaml:9: .*gpus_per_task` is 2, but host a "
                                             r"\(line 3\) has gpus: 1"):
        load(path)


def test_array_slots_follow_the_claimed_gpus(tmp_path: Path) -> None:
    from orchestrator.arrays import plan
    path = tmp_path / "cluster.yaml"
    path.write_text("name: g\nhosts:\n  - address: a\n    gpus: all\njob:\n  entrypoint: job.py\n"
                    "  array:\n    tasks: [[x]]\n    gpus_per_task: 2\n")
    (tmp_path / "job.py").write_text("")
    cluster = gpuclaims.apply(load(path), {0: [0, 1, 2, 3, 5]})
    spec = cluster.job.array
    assert spec is not None and plan.slots(cluster.hosts[0], spec) == 2


CLAIM_AS_OTHER = """
import sys, json, os
from orchestrator.agent import gpus
got = gpus.claim("/home/other/job", json.loads(sys.argv[1]), {"job": "theirs", "user": "nobody"})
print(json.dumps({"ids": got.get("ids"),
                  "holders": {g["index"]: g["holder"] for g in got.get("busy", [])}}), flush=True)
sys.stdin.read()   # holds its claim until told to end
"""


@pytest.mark.skipif(os.getuid() != 0 or not Path("/usr/bin/python3").exists()
                    or not Path("/usr/sbin/runuser").exists(),
                    reason="needs root, runuser and /usr/bin/python3 to act as another user")
def test_claims_hold_between_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's orch job (here `nobody`, through runuser) sees this user's claims
    and its own are seen here: the folder is sticky and shared, each claim file lockable
    by every user."""
    import tempfile
    shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="orch-claims-test-"))
    try:
        shared.chmod(0o755)
        gpu_standin.install(shared / "bin", "/usr/bin/python3")   # one `nobody` may run
        gpu_standin.describe(shared, "local", 4)
        env = {"PATH": f"{shared / 'bin'}:/usr/bin:/bin", "ORCH_FAKE_GPUS_DIR": str(shared),
               "ORCH_GPU_CLAIMS_DIR": str(shared / "claims"), "PYTHONPATH": str(REPO)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("SSH_CONNECTION", raising=False)
        assert gpus.claim("/x/mine", [0], dict(WHO, user="root"))["ids"] == [0]

        other = subprocess.Popen(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                                  "-c", CLAIM_AS_OTHER, "[0, 1]"], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert other.stdout is not None and other.stdin is not None
        busy = json.loads(other.stdout.readline())
        assert busy["ids"] is None and busy["holders"]["0"]["user"] == "root"
        other.stdin.close()
        other.wait(30)

        other = subprocess.Popen(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                                  "-c", CLAIM_AS_OTHER, "[1, 2]"], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert other.stdout is not None and other.stdin is not None
        assert json.loads(other.stdout.readline())["ids"] == [1, 2]
        mine = gpus.claim("/x/more", 2, dict(WHO))
        holders = {g["index"]: g["holder"] for g in mine["busy"]}
        assert holders[1] == {"job": "theirs", "user": "nobody"}
        other.stdin.close()
        other.wait(30)
        assert gpus.claim("/x/more", 2, dict(WHO))["ids"] == [1, 2]   # freed with its process
        assert (shared / "claims").stat().st_mode & 0o7777 == 0o1777
        gpus.release("/x/mine")   # the file root made is lockable by the other user
        other = subprocess.Popen(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                                  "-c", CLAIM_AS_OTHER, "[0]"], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert other.stdout is not None and other.stdin is not None
        assert json.loads(other.stdout.readline())["ids"] == [0]
        other.stdin.close()
        other.wait(30)
    finally:
        for job in list(gpus.HELD):
            gpus.release(job)
        shutil.rmtree(shared, ignore_errors=True)
