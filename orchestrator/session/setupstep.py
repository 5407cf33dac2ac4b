"""`setup:` on every host (after the code sync, before launch), all or nothing, and the
check that follows it: the configured python runs, has torch (the same version
everywhere) and finds the entrypoint. The check runs without setup too when nothing is
pushed (`code:` absent): the entrypoint must then already be on every host."""

from __future__ import annotations

import dataclasses
from typing import TypedDict

from orchestrator.config.inventory import Cluster
from orchestrator.config.setupspec import fingerprint
from orchestrator.errors import HostError
from orchestrator.files.localfiles import LocalFile
from orchestrator.remote.bundle import host_python
from orchestrator.remote.fanout import GroupResult, fan_out
from orchestrator.remote.link import Link
from orchestrator.session.preflight import HostInfo, PreflightReport, torch_mismatch
from orchestrator.session.replies import CommandReply, ProbeReply
from orchestrator.session.shellcmd import Outcome, submit_all, wait_all
from orchestrator.session.shelloutput import HostOutput, Printer
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import timeouts

TAIL = 10  # lines of a failing host's setup output in the message


class Where(TypedDict, total=False):
    """A host's setup request's own fields: `shared` (it runs setup for the hosts that
    share its job folder) or `log` (its log's name, beside theirs)."""

    shared: bool
    log: str


def command_env(cluster: Cluster, job_dir: str) -> dict[str, str]:
    """The environment of setup and exec: the job's `env:` and orch's folders. Not
    ORCH_JOB_DIR: that marks the job's own processes, which `orch stop` ends."""
    env = dict(cluster.job.env)
    env.update(
        ORCH_JOB=cluster.name,
        ORCH_DATA_DIR=f"{job_dir}/data",
        ORCH_OUTPUT_DIR=f"{job_dir}/output",
        PYTHONUNBUFFERED="1",
    )
    return env


def setup_fingerprint(cluster: Cluster, code: list[LocalFile]) -> str:
    assert cluster.setup is not None
    digests = {f.rel: f.digest for f in code}
    script = ""
    if cluster.setup.script is not None:
        local = next((f.path for f in code if f.rel == cluster.setup.script), None)
        script = _read_text(local) if local else ""
    return fingerprint(cluster.setup, digests, script)


def _read_text(path: str, cap: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""


def run_setup(
    cluster: Cluster,
    links: dict[int, Link],
    pre: PreflightReport,
    digest: str,
    force: bool,
    printer: Printer,
) -> dict[int, CommandReply]:
    """Setup on every host in parallel; HostError (exit 3) naming every failing host with
    its last lines. KeyboardInterrupt after the hosts ended their commands."""
    spec = cluster.setup
    assert spec is not None
    where = setup_hosts(cluster, pre, links)
    targets = {i: links[i] for i in where}
    outputs = {i: HostOutput(printer, f"[setup {cluster.hosts[i].label}]", TAIL) for i in targets}
    running, failed = submit_all(
        targets,
        "setup",
        outputs,
        lambda i: dict(
            job_dir=pre.hosts[i].job_dir,
            commands=list(spec.commands),
            script=spec.script,
            env=command_env(cluster, pre.hosts[i].job_dir),
            fingerprint=digest,
            force=force,
            **where[i],
        ),
    )
    outcome = wait_all(running, timeouts.SETUP, failed)
    if outcome.interrupted:
        raise KeyboardInterrupt
    logs = {i: f"{pre.hosts[i].job_dir}/logs/{where[i].get('log', 'setup.log')}" for i in targets}
    raise_setup_failures(cluster, outcome, outputs, logs,
                         {i: pre.hosts[i].job_dir for i in targets})
    return outcome.ok


def setup_hosts(cluster: Cluster, pre: PreflightReport, links: dict[int, Link]
                ) -> dict[int, Where]:
    """{host: its setup request's extra fields} of the hosts that run setup. A host with a
    job folder of its own runs it; of hosts sharing one, the first (`once_per:
    filesystem`: its record, run/shared-setup.json, is theirs) or each of them into a
    log of its own (`once_per: host`)."""
    assert cluster.setup is not None
    out: dict[int, Where] = {}
    for group in pre.groups():
        members = [i for i in group if i in links]
        if len(group) == 1:
            out.update({i: {} for i in members})
        elif cluster.setup.once_per == "filesystem":
            out.update({i: {"shared": True} for i in members[:1]})
        else:
            out.update({i: {"log": f"setup-{cluster.hosts[i].part}.log"} for i in members})
    return out


def raise_setup_failures(
    cluster: Cluster, outcome: Outcome, outputs: dict[int, HostOutput], logs: dict[int, str],
    job_dirs: dict[int, str] | None = None,
) -> None:
    failures = dict(outcome.failed)
    for i, reply in outcome.ok.items():
        if reply.code != 0:
            label, failed = cluster.hosts[i].label, reply.failed or "?"
            tail = "".join(f"\n      | {line}" for line in outputs[i].tail_text())
            failures[i] = HostError(
                f"{label}: `{failed}` exited with {_status(reply.code)}; "
                f"its last lines:{tail or ' (no output)'}",
                hint=f"fix the command (the whole output is in "
                f"{logs[i]} on {label}), then run `{hint_cmd(cluster, 'up')}` again",
            )
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "setup; nothing was started",
                                                    job_dirs=job_dirs)


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"


# ---------------------------------------------------------------- the check after it


def check_ready(cluster: Cluster, links: dict[int, Link], pre: PreflightReport) -> PreflightReport:
    """Each host's configured python, its torch and the entrypoint, checked where the
    job will run; the report's executables and torch versions are this python's."""
    result = fan_out(cluster.hosts, lambda h: _probe(cluster, links[h.index], pre.hosts[h.index]))
    failures = dict(result.failed)
    failures.update(torch_mismatch(cluster, result.ok))
    if failures:
        GroupResult(failed=failures).raise_failures(
            cluster.hosts, "the check before launch; nothing was started"
        )
    return dataclasses.replace(pre, hosts=result.ok)


def _probe(cluster: Cluster, link: Link, info: HostInfo) -> HostInfo:
    host, job = link.host, cluster.job
    r = ProbeReply.of(link.request(
        "probe",
        timeouts.PROBE + 15,
        job_dir=info.job_dir,
        python=host_python(host, info.job_dir, str(cluster.base_dir)),
        entrypoint=job.entrypoint,
        module=job.is_module,
        env=command_env(cluster, info.job_dir),
    ))
    after = " after setup" if cluster.setup else ""
    if r.error or not r.executable:
        raise HostError(
            f"{host.label}: python `{host.python}` does not run{after}: {r.error}",
            hint="make setup create it, or point `python:` at an interpreter that exists there",
        )
    if r.torch is None:
        raise HostError(
            f"{host.label}: torch is not installed for {r.executable}{after}",
            hint="install torch there (e.g. in setup: `pip install torch==<version>`), "
            "or point `python:` at an interpreter that has it",
        )
    if r.entrypoint:
        raise HostError(
            f"{host.label}: the entrypoint is not there{after}: {r.entrypoint} "
            f"(in {info.job_dir})",
            hint="push it with `code: {paths: [...]}`, copy it to that folder, or fix "
            "`job.entrypoint`",
        )
    return dataclasses.replace(info, executable=r.executable, torch=r.torch)


def needs_check(cluster: Cluster) -> bool:
    """After setup (python and torch may be new), or when nothing is pushed (the
    entrypoint was never seen here)."""
    return cluster.setup is not None or not cluster.code.paths
