"""The start of every rank, in the rank's own python (stdlib only; launch copies it from
the bundle to <job>/run/<part>/rankexec.py, and torchrun runs it as the rank):

    torchrun ... --no-python <python> -u <job>/run/<part>/rankexec.py <job dir> module|script <target> [args...]

Before the user's code it points the rank's stdout and stderr straight at
logs/rank-<RANK>.log (nothing is piped, so nothing is lost when the controller is gone),
creates run/heartbeat-<RANK> (ORCH_HEARTBEAT: a rank shows progress by touching it;
created here, so its first touch is a change) and registers faulthandler on STACK_SIGNAL
(SIGUSR2: torchrun neither sends nor forwards it) writing every thread's stack into
run/stack-<RANK>, so that a hang's report (watch/hang.py) can ask a running rank for its
Python stack at no cost. It then runs the module or script in __main__ as `python -m` or
`python script.py` would, with __main__ emptied of this file's names first.

The rank's pid and exit records (run/rank-<RANK>.pid and .exit, how `orch` finds the
earliest failure across hosts) are written by the job's torchrun process
(agent/launcher.py) as it starts the rank and the moment the rank ends, not here: a rank
killed by a signal writes nothing. There is no process between torchrun and the rank.

Like the agent (agent/paths.py), it never follows a link inside the job folder: logs/ and
run/ are opened with O_NOFOLLOW relative to the job folder, the log with
O_NOFOLLOW|O_APPEND. It imports no more than python has already loaded but faulthandler
and _signal (`signal` wraps it in enums: 6-8 ms of every rank's start).
"""


import _signal  # type: ignore[import-not-found]

STACK_SIGNAL = _signal.SIGUSR2   # what agent/stacks.py sends for a rank's stack


def _orch_rank():
    # type: () -> None
    import faulthandler
    import os
    import sys
    job, kind, target = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ["RANK"])
    part = os.environ.get("ORCH_JOB_PART", "")   # this host's records: run/<part>/
    dirs = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    job_fd = os.open(job, dirs)
    run = os.open("run", dirs, dir_fd=job_fd)
    if part:
        run_part = os.open(part, dirs, dir_fd=run)
        os.close(run)
        run = run_part
    logs = os.open("logs", dirs, dir_fd=job_fd)
    os.close(job_fd)
    write = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
    log = os.open("rank-%d.log" % rank, write | os.O_APPEND, 0o644, dir_fd=logs)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, to in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, to)
    for fd in (null, log, logs):
        os.close(fd)
    os.close(os.open("heartbeat-%d" % rank, write | os.O_TRUNC, 0o644, dir_fd=run))
    stack = os.open("stack-%d" % rank, write | os.O_TRUNC | os.O_APPEND, 0o644, dir_fd=run)
    os.close(run)
    faulthandler.register(STACK_SIGNAL, stack, all_threads=True, chain=False)
    os.environ["ORCH_HEARTBEAT"] = os.path.join(job, "run", part, "heartbeat-%d" % rank)
    # the inventory's `python:` as this host runs it (what runs the rank): a rank that
    # starts a helper script uses the job's interpreter, not the first python on PATH
    os.environ.setdefault("ORCH_PYTHON", sys.executable)
    names = sys.modules["__main__"].__dict__
    names_kept = {"__name__": "__main__", "__doc__": None, "__package__": None,
                  "__spec__": None, "__annotations__": {}, "__cached__": None,
                  "__builtins__": names["__builtins__"]}
    names.clear()   # this file's own names are not the user's
    names.update(names_kept)
    sys.argv[:4] = [target]
    if kind == "module":
        import runpy
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target)  # type: ignore[attr-defined]
        return
    path = os.path.abspath(target)
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader
    names.update(__file__=path, __loader__=loader("__main__", path))
    with open(target, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, names)


if __name__ == "__main__":
    _orch_rank()
