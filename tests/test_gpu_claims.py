"""GPU claims on one host (agent/gpus.py) against the stand-in nvidia-smi, in process,
and the controller's side of them (session/gpuclaims.py): which GPUs a job takes, who a
busy GPU's holder is, `gpus: all`, the layout that follows, the messages."""
from __future__ import annotations

import json
import os
import re
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
from orchestrator.session.replies import GpuReply


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
    # the user is the claim file's owner (the kernel's word), never what the job said
    assert holders[0]["job"] == "a" and holders[3] == {"job": "b", "user": "root",
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


FIX = "an admin makes it once: sudo install -d -m 1777 -o root -g root "


def test_the_claims_folder_is_made_by_root_only_and_refused_unless_roots_and_sticky(
        host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever owns the folder may delete anyone's claim in it: it must be root's. Each
    refusal names the folder, why, and the admin's one line."""
    folder = Path(gpus.claims_dir())   # missing: root's agent makes it as the admin would
    assert folder.stat().st_mode & 0o7777 == 0o1777 and folder.stat().st_uid == 0
    os.chown(folder, 65534, 65534)
    with pytest.raises(gpus.ClaimsFolderError, match="belongs to user nobody, who could "
                       "delete anyone's claims; fix: " + re.escape(FIX + str(folder))):
        gpus.claim("/x/a", 1, dict(WHO))
    os.chown(folder, 0, 0)
    folder.chmod(0o777)
    with pytest.raises(gpus.ClaimsFolderError, match="writable by other users and not sticky"):
        gpus.claims_dir()
    folder.chmod(0o1777)
    host.chmod(0o777)   # a parent another user could swap the folder in
    with pytest.raises(gpus.ClaimsFolderError, match=f"is inside {host}, which is writable by other users"):
        gpus.claims_dir()
    host.chmod(0o755)
    monkeypatch.setattr(gpus, "hardlinks_protected", lambda: False)
    with pytest.raises(gpus.ClaimsFolderError, match=re.escape("sysctl -w fs.protected_hardlinks=1")):
        gpus.claims_dir()


def test_a_user_who_is_not_root_never_makes_the_folder(host: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 65534)
    with pytest.raises(gpus.ClaimsFolderError, match=re.escape(
            f"does not exist; fix: {FIX}{host / 'claims'}")):
        gpus.survey()
    assert not (host / "claims").exists()


def test_a_link_as_the_claims_folder_is_refused(host: Path) -> None:
    (host / "elsewhere").mkdir(mode=0o1777)
    os.environ["ORCH_GPU_CLAIMS_DIR"] = str(host / "link")
    (host / "link").symlink_to(host / "elsewhere")
    with pytest.raises(gpus.GpuError, match="not a folder"):
        gpus.claims_dir()


def test_a_refused_claims_folder_is_one_message_with_the_fix(tmp_path: Path) -> None:
    cluster = load(inventory(tmp_path, "- address: a\n  gpus: 2\n"))
    why = str(gpus.ClaimsFolderError("the claims folder /c belongs to user bob, who could delete "
                                     "anyone's claims", FIX + "/c"))
    err = gpuclaims.problem(cluster, cluster.hosts[0], why, None)
    assert err is not None and err.exit_code == 3
    assert err.message == ("a: 2 GPUs asked for, none can be claimed safely: the claims folder /c "
                           "belongs to user bob, who could delete anyone's claims")
    assert err.hint == FIX + "/c"


def test_locks_that_do_not_show_in_proc_locks_refuse_rather_than_look_free(
        host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims are seen through /proc/locks only: a file system whose locks it does not
    list as stat names the files (NFS, another PID namespace) would make every claim
    look free, so our own lock, not found there, refuses."""
    monkeypatch.setattr(gpus, "read_locks", lambda: [])
    with pytest.raises(gpus.ClaimsFolderError, match="do not show in /proc/locks"):
        gpus.claim("/x/a", 1, dict(WHO))
    monkeypatch.setattr(gpus, "probed_holders", lambda folder: {})   # as at the survey
    with pytest.raises(gpus.ClaimsFolderError, match="do not show in /proc/locks"):
        gpus.claim("/x/a", 1, dict(WHO))                             # the look after the lock
    assert "/x/a" not in gpus.HELD and os.listdir(gpus.claims_dir()) == []


def test_a_claim_is_a_private_file_locked_before_it_has_its_name(host: Path) -> None:
    got = gpus.claim("/x/a", [1], dict(WHO))
    names = sorted(os.listdir(gpus.claims_dir()))
    assert len(names) == 2 and names[0].startswith("gpu-GPU-fake-local-1.")
    claim, info = (Path(gpus.claims_dir()) / n for n in names)
    assert claim.stat().st_mode & 0o777 == 0o600 and info.stat().st_mode & 0o777 == 0o644
    assert got["ids"] == [1] and json.loads(info.read_text())["job"] == "a"
    gpus.release("/x/a")   # no process holds it any more: gone
    assert os.listdir(gpus.claims_dir()) == []


def test_a_claim_left_by_an_ended_job_is_swept_and_frees_its_gpu(host: Path) -> None:
    gpus.claim("/x/a", [0], dict(WHO))
    os.close(gpus.HELD.pop("/x/a")[0][1])   # as if its supervisor ended: the lock dropped
    left = gpus.FILES.pop("/x/a")[0]
    assert gpus.claim("/x/b", [0], dict(WHO, job="b"))["ids"] == [0]
    assert not Path(left).exists() and len(os.listdir(gpus.claims_dir())) == 2


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
    busy = [GpuReply(i, f"GPU-{i}", "G", None, None, None, holder, ()) for i, holder in
            enumerate([{"job": "x", "user": "bob"}, {"pids": [{"pid": 7, "user": "carol"}]}, None])]
    err = gpuclaims.problem(cluster, cluster.hosts[0], None, busy)
    assert isinstance(err, gpuclaims.GpusBusy) and err.exit_code == 3
    assert err.message == ("a: 2 GPUs asked for, 1 of 3 free: GPU 0 held by job 'x' (user bob); "
                           "GPU 1 held by pid 7 (user carol), not an orch job")
    assert "--wait" in err.hint and "--exclude a" in err.hint
    few = gpuclaims.problem(cluster, cluster.hosts[0], None, busy[:1])
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

NEEDS_TWO_USERS = pytest.mark.skipif(
    os.getuid() != 0 or not Path("/usr/bin/python3").exists()
    or not Path("/usr/sbin/runuser").exists(),
    reason="needs root, runuser and /usr/bin/python3 to act as another user")


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, dict[str, str]]]:
    """A 4-GPU host both root (this process) and `nobody` (through runuser) use: the
    stand-in and the claims folder where `nobody` can reach them."""
    import tempfile
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="orch-claims-test-"))
    try:
        folder.chmod(0o755)
        gpu_standin.install(folder / "bin", "/usr/bin/python3")   # one `nobody` may run
        gpu_standin.describe(folder, "local", 4)
        env = {"PATH": f"{folder / 'bin'}:/usr/bin:/bin", "ORCH_FAKE_GPUS_DIR": str(folder),
               "ORCH_GPU_CLAIMS_DIR": str(folder / "claims"), "PYTHONPATH": str(REPO)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("SSH_CONNECTION", raising=False)
        yield folder, env
    finally:
        for job in list(gpus.HELD):
            gpus.release(job)
        shutil.rmtree(folder, ignore_errors=True)


def as_nobody(env: dict[str, str], code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                             "-c", code, *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def first_line(proc: subprocess.Popen[str]) -> dict:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())


def end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(30) == 0


@NEEDS_TWO_USERS
def test_claims_hold_between_users(shared: tuple[Path, dict[str, str]]) -> None:
    """Another user's orch job (here `nobody`, through runuser) sees this user's claims
    and its own are seen here."""
    _, env = shared
    assert gpus.claim("/x/mine", [0], dict(WHO, user="root"))["ids"] == [0]
    other = as_nobody(env, CLAIM_AS_OTHER, "[0, 1]")
    busy = first_line(other)
    assert busy["ids"] is None and busy["holders"]["0"]["user"] == "root"
    assert "job_dir" not in busy["holders"]["0"]   # another user's folder is not shown
    end(other)

    other = as_nobody(env, CLAIM_AS_OTHER, "[1, 2]")
    assert first_line(other)["ids"] == [1, 2]
    mine = gpus.claim("/x/more", 2, dict(WHO))
    holders = {g["index"]: g["holder"] for g in mine["busy"]}
    assert holders[1] == {"job": "theirs", "user": "nobody"}
    end(other)
    assert gpus.claim("/x/more", 2, dict(WHO))["ids"] == [1, 2]   # freed with its process
    gpus.release("/x/mine")
    other = as_nobody(env, CLAIM_AS_OTHER, "[0]")
    assert first_line(other)["ids"] == [0]
    end(other)


ATTACK = """
import json, os, sys
folder, uuid = sys.argv[1], sys.argv[2]
broke = []
def tried(what, act):
    try:
        act()
        broke.append(what)
    except OSError:
        pass
for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if os.lstat(path).st_uid == os.getuid():
        continue
    tried("unlink " + name, lambda: os.unlink(path))
    tried("rename " + name, lambda: os.rename(path, path + ".moved"))
    if name.endswith(".claim"):
        tried("open " + name, lambda: os.close(os.open(path, os.O_RDONLY)))
        tried("link " + name, lambda: os.link(path, os.path.join(folder, "gpu-%s.x.claim" % uuid)))
        mine = os.path.join(folder, ".mine")
        open(mine, "w").close()
        tried("replace " + name, lambda: os.rename(mine, path))
        os.unlink(mine)
# a claim of its own on the free GPU, its .info naming root's job and root
import fcntl
claim = os.path.join(folder, "gpu-%s.fake.claim" % uuid)
fd = os.open(claim, os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
with open(claim[:-6] + ".info", "w") as f:
    json.dump({"job": "a", "user": "root", "job_dir": "/x/a", "part": "h"}, f)
print(json.dumps(broke), flush=True)
sys.stdin.read()
"""

PRE_CREATE = """
import os, sys
folder, uuids = sys.argv[1], sys.argv[2:]
for uuid in uuids:   # every name a claim of these GPUs could have, as far as it can guess
    for tok in ("0", "x", "fake"):
        base = os.path.join(folder, "gpu-%s.%s" % (uuid, tok))
        os.close(os.open(base + ".claim", os.O_RDWR | os.O_CREAT, 0o666))
        os.symlink("/etc/passwd", base + "l.claim")
        os.mkfifo(base + "f.claim")
        with open(base + ".info", "w") as f:
            f.write('{"job": "a", "user": "root"}')
print("{}", flush=True)
"""


@NEEDS_TWO_USERS
def test_another_user_cannot_delete_replace_or_fake_a_claim(
        shared: tuple[Path, dict[str, str]]) -> None:
    """`nobody` tries every file of root's claims (delete, rename, open, hard link,
    replace), then holds a claim of its own whose .info names root's job: root's GPUs
    stay held (nobody's own claim of them is refused, naming root), and nobody's claim
    is shown as nobody's."""
    _, env = shared
    claims = Path(gpus.claims_dir())
    assert gpus.claim("/x/a", [0, 1], dict(WHO, user="root"))["ids"] == [0, 1]
    before = {p.name: p.stat().st_ino for p in claims.iterdir()}
    attacker = as_nobody(env, ATTACK, str(claims), "GPU-fake-local-2")
    assert first_line(attacker) == []   # nothing of root's could be touched
    assert {p.name: p.stat().st_ino for p in claims.iterdir() if p.name in before} == before
    other = as_nobody(env, CLAIM_AS_OTHER, "[0]")
    holder = first_line(other)["holders"]["0"]
    assert holder == {"job": "a", "user": "root"}
    end(other)
    found = {g["index"]: g["holder"] for g in gpus.survey()["gpus"]}
    assert found[2] == {"job": "a", "user": "nobody"}   # its own claim, never root's
    assert found[0]["user"] == "root" and found[3] is None
    end(attacker)
    assert {g["index"]: g["holder"] for g in gpus.survey()["gpus"]}[2] is None


@NEEDS_TWO_USERS
def test_names_pre_created_by_another_user_neither_block_nor_break_a_claim(
        shared: tuple[Path, dict[str, str]]) -> None:
    _, env = shared
    claims = Path(gpus.claims_dir())
    pre = as_nobody(env, PRE_CREATE, str(claims), "GPU-fake-local-0", "GPU-fake-local-1")
    assert first_line(pre) == {}
    end(pre)
    assert gpus.claim("/x/a", 2, dict(WHO))["ids"] == [0, 1]   # unlocked files hold nothing
    other = as_nobody(env, CLAIM_AS_OTHER, "[1]")
    assert first_line(other)["holders"]["1"]["user"] == "root"
    end(other)
    attacker = as_nobody(env, ATTACK, str(claims), "GPU-fake-local-3")
    assert first_line(attacker) == []
    end(attacker)


@NEEDS_TWO_USERS
def test_a_claims_folder_an_ordinary_user_made_is_refused_to_everyone(
        shared: tuple[Path, dict[str, str]]) -> None:
    """The reported attack's start: `nobody` ran orch first and owns the folder."""
    folder, env = shared
    (folder / "claims").mkdir(mode=0o1777)
    os.chown(folder / "claims", 65534, 65534)
    with pytest.raises(gpus.ClaimsFolderError, match="belongs to user nobody"):
        gpus.claim("/x/a", [0], dict(WHO))
    seen = subprocess.run(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c",
                           REFUSED], env=env, text=True, capture_output=True, timeout=30)
    assert "belongs to user nobody, who could delete anyone's claims" in seen.stdout, seen


REFUSED = """
from orchestrator.agent import gpus
try:
    print("accepted", gpus.claims_dir())
except gpus.GpuError as e:
    print(e)
"""


@NEEDS_TWO_USERS
def test_a_claims_folder_only_root_may_write_is_one_message_with_the_fix(
        shared: tuple[Path, dict[str, str]]) -> None:
    folder, env = shared
    (folder / "claims").mkdir()
    (folder / "claims").chmod(0o755)   # root's and safe, but no one else can claim in it
    seen = subprocess.run(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c",
                           CLAIM_OR_WHY], env=env, text=True, capture_output=True, timeout=30)
    assert seen.stdout.strip() == (
        f"GPU claims: this user cannot make a claim in the claims folder {folder / 'claims'} "
        f"(Permission denied); fix: an admin lets every GPU user write it: "
        f"sudo chmod 1777 {folder / 'claims'}"), seen


CLAIM_OR_WHY = """
from orchestrator.agent import gpus
try:
    print(gpus.claim("/home/other/job", 1, {"job": "theirs"}))
except gpus.GpuError as e:
    print(e)
"""
