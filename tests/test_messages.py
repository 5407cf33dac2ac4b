"""What orch says when something fails on many hosts or in the inventory: identical
failures as one block with the hosts folded, hints that keep `-c`, a public key given as
`identity_file`, the accept-new line, an entrypoint's did-you-mean."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster, parse
from orchestrator.errors import GroupError, HostError
from orchestrator.remote.fanout import GroupResult
from orchestrator.session.replies import CommandReply
from orchestrator.session.setupstep import raise_setup_failures
from orchestrator.session.shellcmd import Outcome
from orchestrator.session.shelloutput import HostOutput, Printer

FOUR = """name: msg
hosts: ['127.0.1.[1-3]', 127.0.1.30]
job: {entrypoint: job.py}
"""


def cluster_at(path: Path, text: str = FOUR) -> Cluster:
    return parse(text, path)


def refused(cluster: Cluster, i: int, port: int = 2900) -> HostError:
    h = cluster.hosts[i]
    return HostError(f"{h.label} (root@{h.address}:{port}): connection refused on port {port}: "
                     "nothing listens there",
                     hint="check that sshd runs on the host and that the port is right (ssh.port)")


def test_fold_writes_labels_as_a_range() -> None:
    assert fold(["127.0.1.1", "127.0.1.2", "127.0.1.3"]) == "127.0.1.[1-3]"
    assert fold(["gpu01", "gpu02", "gpu04"]) == "gpu[01-02,04]"
    assert fold(["a b", "c"]) == "a b, c"   # not a name ClusterShell reads: listed


def test_identical_failures_are_one_block_with_the_hosts_folded(tmp_path: Path) -> None:
    cluster = cluster_at(tmp_path / "cluster.yaml")
    failed: dict[int, BaseException] = {i: refused(cluster, i) for i in range(3)}
    failed[3] = refused(cluster, 3, port=2222)   # another port: its own block
    with pytest.raises(GroupError) as err:
        GroupResult(failed=failed).raise_failures(cluster.hosts, "preflight")
    assert str(err.value).splitlines() == [
        "4 of 4 hosts failed preflight:",
        "  - 3 hosts: 127.0.1.[1-3]: connection refused on port 2900: nothing listens there",
        "      fix: check that sshd runs on the host and that the port is right (ssh.port)",
        "  - 127.0.1.30 (root@127.0.1.30:2222): connection refused on port 2222: nothing listens there",
        "      fix: check that sshd runs on the host and that the port is right (ssh.port)"]
    assert sorted(err.value.failures) == [0, 1, 2, 3] and err.value.exit_code == 3


def test_a_failed_setup_is_one_block_and_its_hint_keeps_the_inventory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cluster = cluster_at(tmp_path / "runs" / "b.yaml")
    outputs = {i: HostOutput(Printer(quiet=True), f"[setup {h.label}]")
               for i, h in enumerate(cluster.hosts)}
    for out in outputs.values():
        out.feed(b"ERROR: No matching distribution found for tourch\n")
    replies = {i: CommandReply(1, 0.1, failed="pip install tourch") for i in range(4)}
    with pytest.raises(GroupError) as err:
        raise_setup_failures(cluster, Outcome(replies, {}), outputs,
                             {i: f"/r{i}/msg/logs/setup.log" for i in range(4)},
                             {i: f"/r{i}/msg" for i in range(4)})
    text = str(err.value)
    assert text.count("pip install tourch") == 1 and text.count("| ERROR") == 1, text
    assert ("  - 4 hosts: 127.0.1.[1-3,30]: `pip install tourch` exited with code 1; its last "
            "lines:\n      | ERROR: No matching distribution found for tourch") in text, text
    assert ("fix: fix the command (the whole output is in <job dir>/logs/setup.log on each host), "
            "then run `orch up -c runs/b.yaml` again") in text, text


PUBLIC = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKx3kQ9 me@laptop\n"


@pytest.mark.parametrize("command", [["up", "--dry-run"], ["stop"], ["status"]])
def test_a_public_key_as_identity_file_is_exit_2_at_its_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """paramiko says "not a valid OPENSSH private key file" once per host (exit 3); the
    inventory's line says what it is, before any host is contacted."""
    (tmp_path / "id_ed25519.pub").write_bytes(PUBLIC)
    (tmp_path / "job.py").write_text("print(1)\n")
    inv = tmp_path / "cluster.yaml"
    inv.write_text("name: pub\nssh:\n  user: me\n  identity_file: id_ed25519.pub\n"
                   "hosts: [127.0.1.1, 127.0.1.2]\njob: {entrypoint: job.py}\n")
    assert cli.cli([*command, "-c", str(inv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orch: {inv}:4: `identity_file` {tmp_path}/id_ed25519.pub: this is a "
                          "public key"), err
    assert f"fix: use the file without .pub ({tmp_path}/id_ed25519)" in err, err
    assert err.count("public key") == 1 and "Traceback" not in err


def test_accept_new_says_one_line_with_the_fingerprint_as_openssh_shows_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import paramiko

    from orchestrator.ssh.sshtransport import AcceptNewPolicy
    from orchestrator.ui.console import warnings_to_console
    warnings_to_console()
    key = paramiko.RSAKey.generate(1024)

    class Client:
        keys = paramiko.HostKeys()

        def get_host_keys(self) -> paramiko.HostKeys:
            return self.keys
    known = tmp_path / "known_hosts"
    AcceptNewPolicy(str(known), 2222).missing_host_key(Client(), "127.0.1.1", key)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    listed = subprocess.run(["ssh-keygen", "-lf", str(known)], capture_output=True, text=True,
                            check=True).stdout.split()   # 1024 SHA256:... [127.0.1.1]:2222 (RSA)
    assert err == (f"warning: permanently added the host key of [127.0.1.1]:2222 "
                   f"(ssh-rsa {listed[1]}) to {known}\n"), (err, listed)


@pytest.mark.parametrize(("typo", "meant"), [("worker.trian", "worker.train"),
                                             ("worker/trian.py", "worker/train.py"),
                                             ("wroker.train", None)])
def test_an_entrypoint_typo_gets_a_did_you_mean(tmp_path: Path, typo: str, meant: str | None,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Over the modules and files of the pushed code, at the inventory's line (exit 2)."""
    (tmp_path / "worker").mkdir()
    for f in ("__init__.py", "train.py", "data.py"):
        (tmp_path / "worker" / f).write_text("")
    inv = tmp_path / "cluster.yaml"
    inv.write_text("name: d\nhosts: [{address: localhost, connection: local}]\n"
                   f"code: {{paths: [worker]}}\njob:\n  entrypoint: {typo}\n")
    if meant is None:   # `wroker` is no pushed package: an installed one, for the hosts
        assert cli.cli(["up", "--dry-run", "-c", str(inv)]) == 0
        assert "job d: 1 host, world size 1" in capsys.readouterr().out
        return
    assert cli.cli(["up", "--dry-run", "-c", str(inv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orch: {inv}:5: `job.entrypoint` '{typo}' is not in"), err
    assert f"fix: did you mean `{meant}`?" in err, err


def test_a_relative_python_is_taken_from_code_on_an_ssh_host(tmp_path: Path) -> None:
    """`python: ../venv/bin/python`: from the job's code/ folder on an SSH host (where the
    ranks and setup run), whole so that it holds before code/ exists; from the
    inventory's folder on a local host; names and absolute or ~ paths as written."""
    from orchestrator.remote.bundle import host_python
    from orchestrator.session.launch import dry_run_plan
    c = parse("name: py\npython: ../venv/bin/python\nremote_dir: ~/orch\nhosts:\n"
              "  - 10.0.0.8\n  - {address: localhost, connection: local, remote_dir: n0}\n"
              "  - {address: 10.0.0.9, python: python3}\n  - {address: 10.0.0.10, python: ~/v/bin/python}\n"
              "job: {entrypoint: job.py}\n", tmp_path / "cluster.yaml")
    ssh, local, name, home = c.hosts
    assert host_python(ssh, "~/orch/py") == "~/orch/py/venv/bin/python"
    assert host_python(ssh, "/srv/orch/py/") == "/srv/orch/py/venv/bin/python"
    assert host_python(local, "n0/py", str(tmp_path)) == str(tmp_path / "../venv/bin/python")
    assert host_python(name, "~/orch/py") == "python3"
    assert host_python(home, "~/orch/py") == "~/v/bin/python"
    plan = dry_run_plan(c)
    assert "~/orch/py/venv/bin/python -m torch.distributed.run" in plan, plan
