"""Running one step on every host at once: `fan_out` (a thread per host) and its
`GroupResult` (one outcome per host, every failure reported, not just the first)."""
from __future__ import annotations

import _thread
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Host
from orchestrator.errors import EXIT_HOST, GroupError, OrchError

T = TypeVar("T")


# What a host's failure means when its connection was lost meanwhile. The SSH layer
# registers it when imported (ssh/connect.py), which only a command that opened a
# connection does; the fan-out itself knows nothing of SSH.
Explain = Callable[[Host, BaseException], BaseException]
_explainers: list[Explain] = []


def explain_failures_with(explain: Explain) -> None:
    _explainers[:] = [explain]


@dataclass
class GroupResult(Generic[T]):
    """One outcome per host, like Fabric's GroupResult: every failure, not just the first."""

    ok: dict[int, T] = field(default_factory=dict)
    failed: dict[int, BaseException] = field(default_factory=dict)

    def raise_failures(self, hosts: tuple[Host, ...], what: str, result: Any = None,
                       hint: str = "", job_dirs: dict[int, str] | None = None) -> None:
        """Raise one GroupError for every failed host (none: return); `result`: what the
        other hosts did, kept on the error; `hint`: what to do about them all; `job_dirs`:
        each host's job folder, as its messages name it (`<job dir>` in a block)."""
        if not self.failed:
            return
        by_index = {h.index: h for h in hosts}
        failures = {i: self._explained(by_index.get(i), exc) for i, exc in self.failed.items()}
        lines = [f"{len(self.failed)} of {len(hosts)} hosts failed {what}:"]
        for _members, text, fix in grouped(failures, by_index, job_dirs or {}):
            lines.append(f"  - {text}")
            if fix:
                lines.append(f"      fix: {fix}")
        error = GroupError("\n".join(lines), failures,
                           {i: by_index[i].label if i in by_index else str(i) for i in failures},
                           hint=hint, result=result)
        # one kind of failure everywhere keeps its exit code ("already running" is 2);
        # anything mixed, or not orch's own, is a host failure (3)
        codes = {getattr(self.failed[i], "exit_code", EXIT_HOST) for i in self.failed}
        if len(codes) == 1:
            error.exit_code = codes.pop()
        raise error

    @staticmethod
    def _explained(host: Host | None, exc: BaseException) -> BaseException:
        return _explainers[0](host, exc) if host is not None and _explainers else exc


_HOST = "\x00"   # where a host's own name was, in a failure's text made comparable
_JOB_DIR = "\x01"   # where its job folder was
_PREFIX = re.compile("^\x00(?: \\([^)]*\\))?: ")   # `<host>: ` or `<host> (user@host:22): `


def _texts(i: int, exc: BaseException) -> tuple[str, str]:
    text = exc.message if isinstance(exc, OrchError) else f"host {i}: {exc}"
    return text, getattr(exc, "hint", "") or ""


def _anonymous(text: str, host: Host | None, job_dir: str | None) -> str:
    """`text` with the host's job folder replaced by _JOB_DIR, its label and address (as
    whole names) by _HOST."""
    if job_dir:
        text = text.replace(job_dir, _JOB_DIR)
    for name in dict.fromkeys([host.label, host.address] if host else []):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-]|\.\w)", _HOST, text)
    return text


def _shown(text: str) -> str:
    return text.replace(_HOST, "each host").replace(_JOB_DIR, "<job dir>")


def grouped(failures: dict[int, BaseException], by_index: dict[int, Host],
            job_dirs: dict[int, str]) -> list[tuple[list[int], str, str]]:
    """The failures, those that read the same but for the host's name as one block:
    `3 hosts: 127.0.1.[1-3]: <what>` (ClusterShell's folding), so that 64 hosts with one
    wrong port are one message, not 64. (members, text, fix), by first host."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i in sorted(failures):
        text, fix = _texts(i, failures[i])
        host, where = by_index.get(i), job_dirs.get(i)
        key = (_anonymous(text, host, where), _anonymous(fix, host, where))
        groups.setdefault(key, []).append(i)
    out = []
    for (text, fix), members in groups.items():
        if len(members) == 1:
            out.append((members, *_texts(members[0], failures[members[0]])))
            continue
        names = fold([by_index[i].label if i in by_index else str(i) for i in members])
        what = _PREFIX.sub("", text)
        out.append((members, f"{len(members)} hosts: {names}: {_shown(what)}", _shown(fix)))
    return out


def fan_out(hosts: tuple[Host, ...], fn: Callable[[Host], T], limit: int = 256,
            done: Callable[[], None] | None = None) -> GroupResult[T]:
    """Run fn for every host in parallel threads; collect each result or exception.
    `done` is called as each host finishes (progress displays). The limit is above the
    host counts orch is used with: a second wave of hosts would wait for the first
    one's slowest login (a 64-thread limit made 128 hosts take two logins' time).

    Threads are started without waiting for each one to run (threading.Thread.start and
    a thread pool do wait): under the load of a login storm that wait took a scheduling
    slot per thread, and the 64th host's login began a second after the first's."""
    result: GroupResult[T] = GroupResult()
    if not hosts:
        return result
    slots = threading.BoundedSemaphore(min(limit, len(hosts)))
    lock, finished, left = threading.Lock(), threading.Event(), [len(hosts)]
    fatal: list[BaseException] = []

    def one(h: Host) -> None:
        try:
            value = fn(h)
            with lock:
                result.ok[h.index] = value
        except Exception as exc:  # collected: reported together, per host
            with lock:
                result.failed[h.index] = exc
        except BaseException as exc:  # raised in the caller's thread, as a pool's result() would
            fatal.append(exc)
        finally:
            try:
                if done:
                    done()
            finally:
                slots.release()
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        finished.set()
    for h in hosts:
        slots.acquire()
        _thread.start_new_thread(one, (h,))
    # Ctrl-C raises here: the hosts' threads are not waited for; the caller closes the
    # connections, which ends their blocked sends and reads at once
    finished.wait()
    if fatal:
        raise fatal[0]
    result.ok = dict(sorted(result.ok.items()))
    result.failed = dict(sorted(result.failed.items()))
    return result
