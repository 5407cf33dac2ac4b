"""Opening one connection per host, in parallel, with the SSH options in one place."""
from __future__ import annotations

import getpass
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generic, TypeVar

import paramiko

from orchestrator import timeouts
from orchestrator.errors import EXIT_HOST, HostError, OrchError
from orchestrator.inventory import Host
from orchestrator.transport import (AcceptNewPolicy, HostKeyRefused, LocalTransport,
                                    SSHTransport, StrictPolicy, Transport, fingerprint,
                                    known_hosts_name)

T = TypeVar("T")
# aes128-gcm first: on a CPU-bound link it is 1.4-1.6x faster than the alternatives
# (BENCH-ANCHORS); the others stay allowed for servers that lack it.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr",
           "aes192-ctr", "aes256-ctr")


@dataclass(frozen=True)
class Target:
    """Where and how to connect, after ~/.ssh/config and the inventory are merged."""

    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts: str
    policy: str
    timeout: float


def ssh_config() -> paramiko.SSHConfig:
    path = os.environ.get("ORCH_SSH_CONFIG", os.path.expanduser("~/.ssh/config"))
    if path and os.path.isfile(path):
        return paramiko.SSHConfig.from_path(path)
    return paramiko.SSHConfig()


def resolve_target(host: Host, config: paramiko.SSHConfig) -> Target:
    """The inventory wins over ~/.ssh/config, which wins over the defaults (as `ssh -o`)."""
    entry = config.lookup(host.address)
    opts = host.ssh
    identities = (opts.identity_file,) if opts.identity_file else tuple(
        os.path.expanduser(p) for p in entry.get("identityfile", []))
    return Target(
        hostname=entry.get("hostname", host.address),
        port=opts.port or int(entry.get("port", 22)),
        user=opts.user or entry.get("user") or getpass.getuser(),
        identity_files=identities,
        known_hosts=opts.known_hosts,
        policy=opts.host_key_policy,
        timeout=opts.connect_timeout,
    )


def _transport_factory(sock, **kwargs) -> paramiko.Transport:
    t = paramiko.Transport(sock, **kwargs)
    opts = t.get_security_options()
    opts.ciphers = [c for c in CIPHERS if c in opts.ciphers]
    return t


def open_socket(target: Target) -> socket.socket:
    sock = socket.create_connection((target.hostname, target.port), timeout=target.timeout)
    # Nagle + delayed ACK cost ~40 ms on every small request/response (BENCH-ANCHORS)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect_ssh(host: Host, target: Target) -> SSHTransport:
    """Keys or agent only (never a password); the host key is checked per `policy`."""
    client = paramiko.SSHClient()
    if os.path.isfile(target.known_hosts):
        client.load_host_keys(target.known_hosts)
    policy = StrictPolicy if target.policy == "strict" else AcceptNewPolicy
    client.set_missing_host_key_policy(policy(target.known_hosts, target.port))
    client.connect(
        target.hostname, port=target.port, username=target.user,
        key_filename=list(target.identity_files) or None,
        look_for_keys=not target.identity_files, allow_agent=True,
        timeout=target.timeout, banner_timeout=target.timeout, auth_timeout=target.timeout,
        sock=open_socket(target), transport_factory=_transport_factory)
    client.get_transport().set_keepalive(int(timeouts.KEEPALIVE))
    return SSHTransport(host, client)


def explain(host: Host, target: Target, exc: BaseException) -> HostError:
    """Turn what paramiko and the socket layer raise into one message with the fix."""
    where = f"{host.label} ({target.user}@{target.hostname}:{target.port})"
    if isinstance(exc, HostKeyRefused):
        return HostError(f"{where}: {exc.message}", hint=exc.hint)
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostError(
            f"{where}: HOST KEY CHANGED: it now offers {fingerprint(exc.key)}, "
            f"{target.known_hosts} has {fingerprint(exc.expected_key)}",
            hint="someone may be intercepting the connection; if the host was reinstalled, "
                 f"remove the old key with `ssh-keygen -R '{known_hosts_name(target.hostname, target.port)}' "
                 f"-f {target.known_hosts}` and trust the new one")
    if isinstance(exc, paramiko.AuthenticationException):
        return HostError(f"{where}: authentication failed (keys and agent tried)",
                         hint="set ssh.identity_file or add the key to ssh-agent, and check "
                              "that its public key is in ~/.ssh/authorized_keys on the host")
    if "No authentication methods available" in str(exc):
        return HostError(f"{where}: authentication failed: no key to offer (no "
                         "identity_file, no ~/.ssh/id_* key, no ssh-agent)",
                         hint="set ssh.identity_file, or start ssh-agent and `ssh-add` your key")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return HostError(f"{where}: no answer within {target.timeout:g} s",
                         hint="check that the host is up and the address and port are right; "
                              "raise ssh.connect_timeout for slow links")
    if isinstance(exc, (OSError, paramiko.SSHException)):
        return HostError(f"{where}: cannot connect: {exc}",
                         hint="check the address, the port and that sshd runs on the host")
    return HostError(f"{where}: {type(exc).__name__}: {exc}")


def connect(host: Host, config: paramiko.SSHConfig, base_dir: Path) -> Transport:
    if host.connection == "local":
        return LocalTransport(host, cwd=str(base_dir))
    target = resolve_target(host, config)
    try:
        return connect_ssh(host, target)
    except Exception as exc:  # every failure becomes a per-host message
        raise explain(host, target, exc) from None


@dataclass
class GroupResult(Generic[T]):
    """One outcome per host, like Fabric's GroupResult: every failure, not just the first."""

    ok: dict[int, T] = field(default_factory=dict)
    failed: dict[int, BaseException] = field(default_factory=dict)

    def raise_failures(self, hosts: tuple[Host, ...], what: str) -> None:
        if not self.failed:
            return
        lines = [f"{len(self.failed)} of {len(hosts)} hosts failed {what}:"]
        for i in sorted(self.failed):
            exc = self.failed[i]
            text = exc.message if isinstance(exc, OrchError) else f"{hosts[i].label}: {exc}"
            lines.append(f"  - {text}")
            hint = getattr(exc, "hint", "")
            if hint:
                lines.append(f"      fix: {hint}")
        # one kind of failure everywhere keeps its exit code ("already running" is 2);
        # anything mixed, or not orch's own, is a host failure (3)
        codes = {getattr(self.failed[i], "exit_code", EXIT_HOST) for i in self.failed}
        error = HostError("\n".join(lines))
        if len(codes) == 1:
            error.exit_code = codes.pop()
        raise error


def fan_out(hosts: tuple[Host, ...], fn: Callable[[Host], T], limit: int = 64,
            done: Callable[[], None] | None = None) -> GroupResult[T]:
    """Run fn for every host in parallel threads; collect each result or exception.
    `done` is called as each host finishes (progress displays)."""
    result: GroupResult[T] = GroupResult()
    if not hosts:
        return result

    def one(h: Host) -> T:
        try:
            return fn(h)
        finally:
            if done:
                done()
    pool = ThreadPoolExecutor(max_workers=min(limit, len(hosts)))
    try:
        futures = {h.index: pool.submit(one, h) for h in hosts}
        for index, fut in futures.items():
            try:
                result.ok[index] = fut.result()
            except Exception as exc:  # collected: reported together, per host
                result.failed[index] = exc
    except BaseException:
        # Ctrl-C: do not wait for the hosts' threads; the caller closes the connections,
        # which ends their blocked sends and reads at once
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return result


def connect_all(hosts: tuple[Host, ...], base_dir: Path,
                done: Callable[[], None] | None = None) -> GroupResult[Transport]:
    config = ssh_config()
    return fan_out(hosts, lambda h: connect(h, config, base_dir), done=done)


def close_all(transports: dict[int, Transport]) -> None:
    for t in transports.values():
        try:
            t.close()
        except Exception:  # closing is best effort; the process is ending anyway
            pass
