"""`exec`: one command on every host (or a selection) in parallel, through one agent per
host, in the job folder with the job's env."""
from __future__ import annotations

from collections.abc import Sequence

from orchestrator.api import jobs
from orchestrator.api.outcomes import ExecResult, HostExec
from orchestrator.config.hostselect import select
from orchestrator.errors import (
    EXIT_HOST,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    OrchError,
    UsageError,
)
from orchestrator.remote.fanout import GroupResult
from orchestrator.session.shellcmd import Outcome
from orchestrator.session.shelloutput import HostOutput, Printer

KEEP = 1 << 20  # the last bytes of each host's output kept in the result


def exec(inventory: jobs.Inventory, command: Sequence[str], *, hosts: str | None = None,
         echo: bool = False, warn: jobs.Warn | None = None) -> ExecResult:
    """`command` (argv, no shell: `["sh", "-c", "..."]` for one) on every host, or on
    the hosts `hosts` selects (indexes, addresses, labels, ranges). `echo`: print every
    line live to stdout, prefixed `[host]`. A command that exits non-zero is data (the
    host's `exit_code`); Ctrl-C ends it on every host (`interrupted`). A host that could
    not run it (unreachable, lost) raises GroupError (exit 3) with this result in `result`."""
    argv = list(command)
    if not argv:
        raise UsageError("no command given",
                         hint="orch exec -- nvidia-smi   (or: -- sh -c 'cmd | cmd')")
    cluster = jobs.run_cluster(inventory)
    chosen = select(cluster, hosts)
    printer = Printer(quiet=not echo)  # one for all hosts: lines never interleave
    outputs = {h.index: HostOutput(printer, f"[{h.label}]", keep=KEEP) for h in chosen}
    # the job folders from the state (as `up` resolved them); the inventory's when the job
    # never started or its state is damaged: exec must work then too
    st = jobs.state_or_warn(cluster, warn or jobs.log.warning, "using the inventory's job folders")
    session = jobs.open_session(cluster, st, chosen)
    try:
        outcome = session.exec(argv, outputs)
    finally:
        session.close()
    outcome.failed.update({i: e for i, e in session.failed.items() if i in outputs})
    rows = []
    for h in chosen:
        err = outcome.failed.get(h.index)
        rows.append(HostExec(host=h.label, index=h.index,
                             exit_code=exit_of(outcome, h.index),
                             output=outputs[h.index].text(),
                             output_truncated=outputs[h.index].dropped > 0,
                             error=None if err is None else message(err)))
    result = ExecResult(command=argv, hosts=rows, interrupted=outcome.interrupted,
                        exit_code=exit_code(outcome), failures=dict(outcome.failed))
    GroupResult(failed=result.failures).raise_failures(chosen, "to run the command", result=result)
    return result


def message(err: BaseException) -> str:
    return err.message if isinstance(err, OrchError) else str(err)


def exit_of(outcome: Outcome, index: int) -> int | None:
    reply = outcome.ok.get(index)
    return reply.code if reply is not None else None


def exit_code(outcome: Outcome) -> int:
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    if outcome.failed:
        return EXIT_HOST
    return EXIT_JOB_FAILED if any(r.code != 0 for r in outcome.ok.values()) else EXIT_OK
