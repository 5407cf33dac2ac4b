"""`forward`: local ports relayed to ports on one host of the job (rank 0's by default)
over orch's SSH connection, until closed (session/forward.py does the relaying)."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from orchestrator.api import jobs
from orchestrator.api.outcomes import ForwardResult, PortForward
from orchestrator.config.hostselect import select
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import UsageError
from orchestrator.remote.transport import Transport
from orchestrator.session.forward import Forward, Report, Spec, open_forwards


class Forwarding:
    """The open forwards: `result` says which local port goes where; `wait()` blocks
    until `close()` (or Ctrl-C in the caller); a context manager that closes them."""

    def __init__(self, result: ForwardResult, transport: Transport, forwards: list[Forward]) -> None:
        self.result, self.transport, self.forwards = result, transport, forwards
        self.closed = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        """True once closed. Waits in short steps so that Ctrl-C reaches the caller."""
        step = 0.2 if timeout is None else min(0.2, timeout)
        waited = 0.0
        while not self.closed.wait(step):
            waited += step
            if timeout is not None and waited >= timeout:
                return False
        return True

    def close(self) -> None:
        for f in self.forwards:
            f.close()
        self.transport.close()
        self.closed.set()

    def __enter__(self) -> Forwarding:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def forward(inventory: jobs.Inventory, ports: Sequence[str], *, host: str | None = None,
            rank: int | None = None, report: Report | None = None) -> Forwarding:
    """Forward each of `ports` (REMOTE_PORT[:LOCAL_PORT]) from 127.0.0.1 here to localhost
    on the host `host` selects, or the host of global rank `rank` (default rank 0's),
    over one SSH connection. `report(message, fix)` hears of a connection that failed
    (nothing listens there): it is said, the forward goes on. UsageError (exit 2) for a
    bad port or selection, HostError (exit 3) when the host cannot be reached."""
    specs = [Spec.parse(p) for p in ports]
    if not specs:
        raise UsageError("no port given", hint="orch forward 6006   (TensorBoard's port)")
    cluster = jobs.run_cluster(inventory)
    target = chosen(cluster, host, rank)
    transport, forwards = open_forwards(target, cluster.base_dir, specs, report or ignore)
    rows = [PortForward(remote_port=f.spec.remote, local_port=f.local,
                        url=f"http://127.0.0.1:{f.local}/") for f in forwards]
    return Forwarding(ForwardResult(host=target.label, forwards=rows), transport, forwards)


def chosen(cluster: Cluster, host: str | None, rank: int | None) -> Host:
    """The one host: by selection, by a rank's placement, or rank 0's."""
    if host is not None and rank is not None:
        raise UsageError("--host and --rank name the host twice", hint="give one of them")
    if host is None:
        return cluster.host_of(rank or 0)   # a rank outside the job: exit 2, said there
    hosts = select(cluster, host)
    if len(hosts) != 1:
        raise UsageError(f"--host {host} selects {len(hosts)} hosts; a forward goes to one",
                         hint="name one host (an address, a label or an index)")
    return hosts[0]


def ignore(message: str, fix: str) -> None:
    pass
