"""What went wrong while opening an SSH connection, in words: one message and its fix per
failure, chosen by the step the connection had reached (name lookup and TCP, the SSH
banner, the key exchange, the host key, authentication) or, for a connection that broke
later, by how it broke."""
from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import paramiko
from paramiko.ssh_exception import IncompatiblePeer  # not re-exported by the stubs

from orchestrator.config.inventory import Host
from orchestrator.errors import HostError
from orchestrator.ssh.sshtransport import HostKeyRefused, fingerprint, known_hosts_name
from orchestrator.ui.wording import hint_cmd

if TYPE_CHECKING:
    from orchestrator.ssh.target import Target

DEFAULT_KEYS = ("id_rsa", "id_ecdsa", "id_ed25519")  # what paramiko looks for in ~/.ssh


class ConnectFailed(Exception):
    """A connection that failed, with the step it reached (for the message)."""

    def __init__(self, cause: BaseException, step: str) -> None:
        super().__init__(str(cause))
        self.cause, self.step = cause, step


class ForwardFailed(Exception):
    """The bastion could not open the TCP connection to the host for us."""

    def __init__(self, bastion: Target, exc: BaseException) -> None:
        reason = getattr(exc, "text", "") or str(exc) or type(exc).__name__
        super().__init__(f"bastion {bastion.name} could not connect to it: {reason}")


class BastionError(HostError):
    """A bastion could not be reached: every host behind it reports it."""


def _chain(exc: BaseException) -> list[BaseException]:
    seen = [exc]
    while True:
        nxt = seen[-1].__cause__ or seen[-1].__context__
        if nxt is None or nxt in seen:
            return seen
        seen.append(nxt)


def _is(exc: BaseException, *types: type) -> bool:
    return any(isinstance(e, types) for e in _chain(exc))


def dropped_before_banner(exc: ConnectFailed) -> bool:
    """Closed or reset before the SSH banner, which sshd's MaxStartups does to one
    connection too many (the same failure as `_banner_failure`'s first case), or
    during the key exchange, before any login: a host's sshd under a load of hundreds of
    connections at once was seen to close one there (300 hosts on one machine). Nothing
    has run on the host either way, so one more try is safe."""
    cause = exc.cause   # a reset may come before paramiko's transport exists ("tcp")
    return exc.step in ("tcp", "banner", "kex") and (
        _is(cause, ConnectionResetError, EOFError) or "reset" in str(cause).lower())


def _tcp_failure(target: Target, exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, ForwardFailed):
        return (str(exc), "check the address as the bastion sees it (its DNS, its routes), that "
                          "sshd runs on the host, and that the bastion allows TCP forwarding "
                          "(AllowTcpForwarding yes)")
    if isinstance(exc, socket.gaierror):
        return (f"cannot resolve the host name {target.hostname!r} ({exc.strerror})",
                "check the address (and HostName in ~/.ssh/config); the name must resolve "
                "on this machine (`getent hosts NAME`)")
    if isinstance(exc, ConnectionRefusedError):
        return (f"connection refused on port {target.port}: nothing listens there",
                "check that sshd runs on the host and that the port is right (ssh.port)")
    if isinstance(exc, (ConnectionResetError, EOFError)):
        return _banner_failure(target, exc)
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return (f"no answer to the TCP connection within {target.timeout:g} s",
                "check that the host is up and the address is right (a firewall may drop "
                "the packets); raise ssh.connect_timeout for slow links")
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return (f"cannot connect to port {target.port}: {reason}",
            "check the address, the port, and the network path to the host")


def _banner_failure(target: Target, exc: BaseException) -> tuple[str, str]:
    if _is(exc, ConnectionResetError, EOFError) or "reset" in str(exc).lower():
        how = "reset" if _is(exc, ConnectionResetError) or "reset" in str(exc).lower() else "closed"
        return (f"the connection was {how} before sshd sent its SSH banner",
                "sshd may refuse this machine (MaxStartups, tcp wrappers, fail2ban) or the "
                "port is not sshd's; try `ssh -v` to the host")
    if "Indecipherable" in str(exc) or "Invalid SSH banner" in str(exc):
        return (f"port {target.port} does not speak SSH ({exc})",
                "check the port (ssh.port): something else listens there")
    return (f"the TCP connection was accepted but no SSH banner came within {target.timeout:g} s",
            "sshd on the host is hung or overloaded, or the port is not sshd's; check the "
            "host, or raise ssh.connect_timeout for slow links")


def _kex_failure(target: Target, exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, IncompatiblePeer) or "ncompatible" in str(exc):
        return (f"no SSH algorithm in common with the host ({exc})",
                "update sshd on the host (orch needs aes-gcm or aes-ctr and a modern key exchange)")
    if _is(exc, ConnectionResetError, EOFError):
        return ("the connection was closed during the SSH key exchange",
                "check sshd's log on the host (it may refuse this client's algorithms)")
    return (f"sshd sent its banner but the SSH key exchange did not finish within "
            f"{target.timeout:g} s",
            "sshd on the host is stuck or overloaded; check it, or raise ssh.connect_timeout")


def _auth_failure(target: Target, exc: BaseException) -> tuple[str, str]:
    text = str(exc)
    if "timeout" in text.lower() or isinstance(exc, (socket.timeout, TimeoutError)):
        return (f"authentication did not finish within {target.timeout:g} s",
                "sshd stalls at login (slow reverse DNS: UseDNS no; PAM; a hung home "
                "directory); check the host, or raise ssh.connect_timeout")
    if "No authentication methods available" in text:
        return ("authentication failed: no key to offer (no identity_file, no ~/.ssh/id_* key, "
                "no ssh-agent)", "set ssh.identity_file, or start ssh-agent and `ssh-add` your key")
    if isinstance(exc, paramiko.AuthenticationException):
        return (f"authentication refused for user {target.user!r}; tried {keys_tried(target)}",
                f"put the public key in ~{target.user}/.ssh/authorized_keys on the host, or set "
                "ssh.user / ssh.identity_file to a login and key it accepts")
    if _is(exc, ConnectionResetError, EOFError):
        return ("the connection was closed during authentication",
                "check sshd's log on the host (AllowUsers, MaxAuthTries)")
    return (f"authentication failed: {text or type(exc).__name__}",
            "check the key and the user (ssh.user, ssh.identity_file)")


def keys_tried(target: Target) -> str:
    """The keys paramiko offered: files by path (and fingerprint), agent keys by fingerprint."""
    files = list(target.identity_files) or [
        p for p in (os.path.expanduser(f"~/.ssh/{k}") for k in DEFAULT_KEYS) if os.path.exists(p)]
    names = [f"{p} ({_file_fingerprint(p)})" for p in files]
    try:
        agent = paramiko.Agent()
        names += [f"agent key {fingerprint(k)}" for k in agent.get_keys()]
        agent.close()
    except Exception:  # no agent, or one that does not answer: nothing was tried there
        pass
    return ", ".join(names) or "no key"


def _file_fingerprint(path: str) -> str:
    try:
        return fingerprint(paramiko.PKey.from_path(path))
    except Exception:  # encrypted or unreadable: the path alone names it
        return "cannot read its fingerprint"


_STEPS = {"tcp": _tcp_failure, "banner": _banner_failure, "kex": _kex_failure,
          "auth": _auth_failure}


def describe(target: Target, exc: BaseException) -> tuple[str, str]:
    """(what happened, the fix) for any failure of opening a connection to target."""
    step = exc.step if isinstance(exc, ConnectFailed) else "tcp"
    cause = exc.cause if isinstance(exc, ConnectFailed) else exc
    if isinstance(cause, HostKeyRefused):
        return cause.message, cause.hint   # str() would repeat the hint
    if isinstance(cause, paramiko.BadHostKeyException):
        name = known_hosts_name(target.hostname, target.port)
        return (f"HOST KEY CHANGED: it now offers {fingerprint(cause.key)}, "
                f"{target.known_hosts} has {fingerprint(cause.expected_key)}",
                "someone may be intercepting the connection; if the host was reinstalled, "
                f"remove the old key with `ssh-keygen -R '{name}' -f {target.known_hosts}` "
                "and trust the new one")
    if isinstance(cause, paramiko.AuthenticationException) or step == "auth":
        return _auth_failure(target, cause)
    return _STEPS[step](target, cause)


def explain_lost(host: Host, exc: BaseException) -> HostError:
    """A connection that broke during a command (reset, closed, keepalive gave up)."""
    if _is(exc, ConnectionResetError):
        why = "reset by the network or the host"
    elif _is(exc, EOFError) or "closed" in str(exc).lower():
        why = "closed by the host"
    else:
        why = str(exc) or type(exc).__name__
    return HostError(f"{host.label}: the connection was lost during the command ({why})",
                     hint="check that the host is up and reachable, then run the command again "
                          f"(`{hint_cmd(None, 'status')}` shows what still runs)")
