"""Opening one connection per host, in parallel, where sshconfig.py says to connect.

Whatever the network does, a failed connection becomes one `HostError` per host that
says what happened (by the step that failed: name lookup, TCP, SSH banner, key exchange,
host key, authentication) and what to do; mistakes on this machine (a missing key file,
an unreadable ~/.ssh/config, a known_hosts that cannot be written) are exit 2 instead.
Hosts behind bastions (`proxy_jump`) are reached through one shared connection per
bastion (`Bastions`), each hop's host key checked under the host's policy.
"""
from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401  (why: see open_socket)
import logging
import os
import random
import re
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import paramiko

from orchestrator.config.inventory import Host
from orchestrator.errors import (
    HostError,
    InventoryError,
    OrchError,
    UsageError,
)
from orchestrator.remote.fanout import explain_failures_with
from orchestrator.remote.transport import LocalTransport, Transport
from orchestrator.ssh.faults import (
    BastionError,
    ConnectFailed,
    ForwardFailed,
    describe,
    dropped_before_banner,
    explain_lost,
)
from orchestrator.ssh.knownhosts import IndexedHostKeys
from orchestrator.ssh.sshconfig import resolve_target
from orchestrator.ssh.sshtransport import (
    AcceptNewPolicy,
    HostKeyRefused,
    QuietPacketizer,
    SSHTransport,
    StrictPolicy,
)
from orchestrator.ssh.target import Target
from orchestrator.wire import timeouts

# aes128-gcm first: on a CPU-bound link it is 1.4-1.6x faster than the alternatives
# (measured on loopback sshd); the others stay allowed for servers that lack it.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "aes128-ctr",
           "aes192-ctr", "aes256-ctr")


# ---------------------------------------------------------------- paramiko's own output

def quiet_paramiko() -> None:
    """paramiko logs every failure of its transport thread (with a traceback) through the
    `paramiko` logger, which Python prints to stderr when nobody configured it. orch says
    the same thing in one line per host, so that output is only shown with ORCH_DEBUG=1."""
    log = logging.getLogger("paramiko")
    if os.environ.get("ORCH_DEBUG") == "1":
        if not log.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("paramiko %(name)s: %(message)s"))
            log.addHandler(handler)
        log.setLevel(logging.DEBUG)
        return
    log.addHandler(logging.NullHandler())
    log.setLevel(logging.CRITICAL + 1)
    log.propagate = False
    previous = threading.excepthook

    def hook(args: Any) -> None:
        # a transport thread that dies while the interpreter exits would print a traceback
        if isinstance(args.thread, paramiko.Transport):
            return
        previous(args)
    if not getattr(threading.excepthook, "_orch", False):
        hook._orch = True  # type: ignore[attr-defined]  # a mark on our own function
        threading.excepthook = hook


quiet_paramiko()


# ---------------------------------------------------------------- local checks

# Descriptors: one socket per host (a bastion's hosts share its one), plus what Python,
# the local files and the terminal hold. A default login session's soft limit is 1,024.
FDS_BASE = 64


def check_fd_limit(hosts: int) -> None:
    """Raise this process's soft limit on open files to its hard limit (any process may),
    so that a thousand hosts fit; when even the hard limit is below what `hosts`
    connections need, say so before connecting (exit 2) rather than fail half way."""
    import resource
    need = hosts + FDS_BASE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 2 * need:
        target = hard if hard == resource.RLIM_INFINITY else max(soft, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        raise UsageError(f"{hosts} hosts need about {need} open files, and this session "
                         f"allows {soft} (ulimit -n; its hard limit is {hard})",
                         hint=f"raise the limit: `ulimit -n {need * 2}` (as root, or in "
                              "/etc/security/limits.conf for your user), then run orch again")


def check_local_files(hosts: tuple[Host, ...]) -> None:
    """What would fail on this machine, before any host is contacted (exit 2)."""
    seen: set[str] = set()
    for host in hosts:
        if host.is_local:
            continue
        opts = host.ssh
        if opts.identity_file and opts.identity_file not in seen:
            seen.add(opts.identity_file)
            _check_identity(opts.identity_file, opts.identity_file_at)
        if opts.known_hosts not in seen:
            seen.add(opts.known_hosts)
            _check_known_hosts(opts.known_hosts)


# the first bytes of a public key file: `<type> AAAA...` (OpenSSH) or RFC 4716's header
_PUBLIC_KEY = re.compile(rb"^(?:(?:ssh|ecdsa|sk)-[\w@.-]+ AAAA|---- BEGIN SSH2 PUBLIC KEY)")


def _check_identity(path: str, at: tuple[str, int] | None) -> None:
    file, line = at or ("the inventory", None)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except FileNotFoundError:
        raise InventoryError(file, line, f"`identity_file` {path}: no such file",
                             "fix the path (relative paths start at the folder of the inventory), "
                             "or remove the line to use ssh-agent and ~/.ssh/config") from None
    except OSError as exc:
        raise InventoryError(file, line, f"`identity_file` {path} cannot be read: {exc.strerror}",
                             f"give it to this user with mode 600 (chmod 600 {path}), or "
                             "point identity_file at a readable private key") from None
    if _PUBLIC_KEY.match(head):   # paramiko would say "not a valid private key" per host
        private = path[:-4] if path.endswith(".pub") else ""
        raise InventoryError(file, line, f"`identity_file` {path}: this is a public key",
                             f"use the file without .pub ({private})" if private else
                             "point identity_file at the private key (the file without .pub)")


def _check_known_hosts(path: str) -> None:
    if not os.path.exists(path):
        return  # strict: every key will be reported unknown; accept-new: created on first use
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read known_hosts: {exc.strerror}",
                         hint=f"make it a readable file (chmod 600 {path}), or set "
                              "`ssh.known_hosts` to another file") from None


# ---------------------------------------------------------------- opening one connection

class _Client(paramiko.SSHClient):
    """An SSHClient that also releases what it was tunnelled through when it closes."""

    on_close: Callable[[], None] | None = None

    def close(self) -> None:
        t = self.get_transport()
        if t is not None and t not in _lost:
            # remember whether it had died on its own before we closed it
            _lost[t] = None if t.is_active() else (t.saved_exception or EOFError())
        if t is not None:
            wake(t)
        super().close()
        release, self.on_close = self.on_close, None
        if release is not None:
            release()

    def live_transport(self) -> paramiko.Transport:
        t = self.get_transport()
        if t is None:  # only before connect() or after close()
            raise EOFError("the SSH connection is closed")
        return t


def _step(t: paramiko.Transport | None) -> str:
    if t is None:
        return "tcp"
    if not t.remote_version:
        return "banner"
    if not t.initial_kex_done:
        return "kex"
    return "auth"


# paramiko's transport thread wakes whenever its socket's timeout (0.1 s) passes, to see
# whether it was closed and whether a keepalive is due: 300 idle hosts made 3,000 wake-ups
# a second, each taking the GIL from the threads with work (half the controller's system
# time, measured at 300 hosts). While connecting, once a second (the banner's and the
# key exchange's timeouts are checked at a wake); once logged in, once a keepalive period
# (`idle`): nothing else is due on an idle connection (a rekey starts at the next packet
# read), and our own close wakes the thread at once (wake).
IDLE_WAKE_S = 1.0


def idle(t: paramiko.Transport, period: float) -> None:
    """A logged-in connection's keepalive every `period` (timeouts.keepalive: fewer per
    connection as there are more hosts), its thread woken only that often: 1,000 hosts
    woke the controller 1,000 times a second at IDLE_WAKE_S, 100 times at 10 s. An idle
    connection sends a packet within twice the period (a wake may come just before the
    keepalive is due); one that reads a packet sooner is not idle."""
    t.set_keepalive(int(period))
    t.sock.settimeout(period)   # a bastion's channel too: its close wakes its reader


# What a host may send that this machine has not read yet: paramiko keeps a channel's
# incoming bytes up to its window, and when the printer falls behind (a slow terminal,
# `| less`, a flood of rank lines: bench/linerate.py) every host's window fills, 2 MiB
# each by default: 2 GiB at 1,000 hosts. Past that the host's sshd waits, then the
# agent's write, and the rest stays in the rank's log file on the host, read when the
# printer catches up. The window is paramiko's 2 MiB (what a pull over a long link needs)
# up to 128 hosts, then smaller per host, so that all of them hold at most
# WINDOW_BUDGET, and never below WINDOW_MIN.
WINDOW_MAX = 2 << 20
WINDOW_MIN = 256 << 10
WINDOW_BUDGET = 256 << 20


def window(hosts: int) -> int:
    """The receive window of each of `hosts` connections' channels, in bytes."""
    return max(WINDOW_MIN, min(WINDOW_MAX, WINDOW_BUDGET // max(1, hosts)))


def wake(t: paramiko.Transport) -> None:
    """Shut the socket down under a transport about to be closed: its thread, asleep in
    recv() for up to IDLE_WAKE_S, sees the end now and exits (closing the descriptor
    alone does not wake a recv() in another thread). A bastion's channel is left as is."""
    if isinstance(t.sock, socket.socket):
        with contextlib.suppress(OSError):
            t.sock.shutdown(socket.SHUT_RDWR)


def _transport_factory(made: list[paramiko.Transport], timeout: float
                       ) -> Callable[..., paramiko.Transport]:
    def factory(sock: Any, **kwargs: Any) -> paramiko.Transport:
        t = paramiko.Transport(sock, packetizer_class=QuietPacketizer, **kwargs)
        # the key exchange gets the user's connect timeout too: paramiko's own 15 s ended
        # 200 logins at once on 2 cores with an EOFError, told as "closed" by sshd
        t.handshake_timeout = timeout
        if isinstance(sock, socket.socket):
            sock.settimeout(IDLE_WAKE_S)   # paramiko set 0.1 s
        opts = t.get_security_options()
        opts.ciphers = [c for c in CIPHERS if c in opts.ciphers]
        made.append(t)
        return t
    return factory


def open_socket(target: Target) -> socket.socket:
    """A TCP connection to the host. getaddrinfo encodes the name with the `idna` codec,
    whose module is imported at its first use: imported with this module instead, or
    the first wave of connects (256 threads) queues on that import's lock."""
    try:
        sock = socket.create_connection((target.hostname, target.port), timeout=target.timeout)
    except OSError as exc:
        raise ConnectFailed(exc, "tcp") from None
    # Nagle + delayed ACK cost ~40 ms on every small request/response (measured here)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# path -> (its bytes, parsed): parsing builds a key object per line, so parsing the file
# once per host made a command O(hosts x lines) of CPU (0.6 s at 128 hosts); reading it
# is cheap, and comparing the bytes catches any change (accept-new, a test's rewrite)
_known: dict[str, tuple[bytes, paramiko.HostKeys]] = {}
_known_lock = threading.Lock()


def known_host_keys(path: str) -> paramiko.HostKeys:
    """known_hosts parsed once while it does not change: hosts' clients share it. A key
    that accept-new records is added to it as well as to the file."""
    with open(path, "rb") as f:
        data = f.read()
    with _known_lock:
        cached = _known.get(path)
        if cached is None or cached[0] != data:
            keys = IndexedHostKeys(path)
            cached = _known[path] = (data, keys)
        return cached[1]


def _load_known_hosts(client: paramiko.SSHClient, path: str) -> None:
    if not os.path.isfile(path):
        return
    try:
        # SSHClient keeps them in _host_keys (what load_host_keys fills); shared, not copied
        client._host_keys = known_host_keys(path)  # type: ignore[attr-defined]
    except Exception as exc:  # paramiko skips most bad lines; what it raises is fatal
        raise UsageError(f"{path}: cannot read known_hosts: {exc}",
                         hint=f"fix or remove the damaged line (`ssh-keygen -l -f {path}` "
                              "names it), or set `ssh.known_hosts` to another file") from None


def open_client(target: Target, sock: Any) -> _Client:
    """Keys or agent only (never a password); the host key is checked per `policy`.
    Raises ConnectFailed (or an OrchError for a mistake on this machine)."""
    client = _Client()
    made: list[paramiko.Transport] = []
    try:
        _load_known_hosts(client, target.known_hosts)
        policy = StrictPolicy if target.policy == "strict" else AcceptNewPolicy
        client.set_missing_host_key_policy(policy(target.known_hosts, target.port))
        client.connect(
            target.hostname, port=target.port, username=target.user,
            # paramiko takes a list of key files as well; its stubs only say str
            key_filename=list(target.identity_files) or None,  # type: ignore[arg-type]
            look_for_keys=not target.identity_files, allow_agent=True,
            timeout=target.timeout, banner_timeout=target.timeout, auth_timeout=target.timeout,
            sock=sock, transport_factory=_transport_factory(made, target.timeout))
        live = client.live_transport()
        idle(live, target.keepalive)
        live.default_window_size = target.window   # every channel opened on it
        return client
    except BaseException as exc:
        step = _step(made[0] if made else None)
        cause: BaseException = exc
        if step == "kex" and made[0].packetizer.handshake_timed_out():
            cause = socket.timeout("the key exchange timed out")   # paramiko: EOFError
        client.close()
        sock.close()
        # a refused host key is the host's failure, told with its name and hop like any
        # other; other OrchErrors are mistakes on this machine (exit 2) and go up as they are
        if isinstance(exc, KeyboardInterrupt) or (
                isinstance(exc, OrchError) and not isinstance(exc, HostKeyRefused)):
            raise
        raise ConnectFailed(cause, step) from None


def connect_ssh(host: Host, target: Target, bastions: Bastions) -> SSHTransport:
    if target.jumps:
        sock, release = bastions.tunnel(target)
        try:
            client = open_client(target, sock)
        except BaseException:
            release()
            raise
        client.on_close = release
    else:
        client = in_waves(target)
    _opened[_key(host)] = weakref.ref(client.live_transport())
    return SSHTransport(host, client)


# sshd's MaxStartups (10:30:100 by default) drops connections past 10 that have not
# logged in yet: many hosts behind one sshd (containers, a login node's ports), or
# a shared bastion's sshd, see some connections closed before the banner (or, on a
# loaded sshd, during the key exchange). Those are tried again, spread out, within the
# connect timeout; anything else fails at once.
WAVE_RETRIES = 3
WAVE_BACKOFF = 0.25   # seconds, doubled at each try, times a random factor in [0.5, 1.5)


def in_waves(target: Target) -> _Client:
    """open_client, again (after a random back-off) while the connection is closed or
    reset before a login (faults.dropped_before_banner) and time is left in the connect
    timeout."""
    deadline = time.monotonic() + target.timeout
    for attempt in range(WAVE_RETRIES + 1):
        try:
            return open_client(target, open_socket(target))
        except ConnectFailed as exc:
            delay = WAVE_BACKOFF * 2 ** attempt * random.uniform(0.5, 1.5)
            if not dropped_before_banner(exc) or attempt == WAVE_RETRIES or \
                    time.monotonic() + delay >= deadline:
                raise
            time.sleep(delay)
    raise AssertionError("unreachable")   # the loop returns or raises


# host index -> its paramiko transport: a command that fails on a host whose connection
# died with an error is reported as the lost connection it is (the channel only sees EOF)
_opened: dict[tuple[int, str, int | None], weakref.ref[paramiko.Transport]] = {}
# a transport closed by orch -> what had killed it before that (None: it was alive)
_lost: weakref.WeakKeyDictionary[paramiko.Transport, BaseException | None] = \
    weakref.WeakKeyDictionary()


def _key(host: Host) -> tuple[int, str, int | None]:
    return host.index, host.address, host.ssh.port


def connection_error(host: Host) -> BaseException | None:
    """Why the host's connection died (reset, closed, keepalive timeout), or None."""
    ref = _opened.get(_key(host))
    t = ref() if ref is not None else None
    if t is None:
        return None
    if t in _lost:
        return _lost[t]
    return None if t.is_active() else (t.saved_exception or EOFError())


# ---------------------------------------------------------------- what went wrong

def explain(host: Host, target: Target, exc: BaseException) -> HostError:
    """Turn what paramiko and the socket layer raise into one message with the fix."""
    what, hint = describe(target, exc)
    return HostError(f"{host.label} ({target.address}): {what}", hint=hint)


# ---------------------------------------------------------------- bastions

HopKey = tuple[tuple[str, str, int], ...]  # (user, hostname, port) of each bastion


@dataclass
class _Hop:
    lock: threading.Lock = field(default_factory=threading.Lock)
    client: _Client | None = None
    error: HostError | None = None
    users: int = 0


class Bastions:
    """One connection per bastion, shared by every host behind it: opened by the first
    host that needs it (the others wait on its lock), closed when the last host closes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hops: dict[HopKey, _Hop] = {}
        self._sealed = False

    def tunnel(self, target: Target) -> tuple[paramiko.Channel, Callable[[], None]]:
        """A direct-tcpip channel to target through its last bastion, and its release."""
        key = tuple((j.user, j.hostname, j.port) for j in target.jumps)
        hop, client = self._open(key, target.jumps)
        try:
            chan = client.live_transport().open_channel(
                "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                timeout=target.timeout)
        except Exception as exc:
            raise ConnectFailed(ForwardFailed(target.jumps[-1], exc), "tcp") from None
        with self._lock:
            hop.users += 1
        return chan, lambda: self._release(key)

    def _open(self, key: HopKey, chain: tuple[Target, ...]) -> tuple[_Hop, _Client]:
        with self._lock:
            hop = self._hops.setdefault(key, _Hop())
        with hop.lock:
            if hop.error is not None:  # a copy per host: each is raised in its own thread
                raise BastionError(hop.error.message, hint=hop.error.hint)
            if hop.client is None:
                try:
                    hop.client = self._connect(chain)
                except HostError as exc:
                    hop.error = exc
                    raise
            client = hop.client
        return hop, client

    def _connect(self, chain: tuple[Target, ...]) -> _Client:
        bastion = replace(chain[-1], jumps=chain[:-1])
        try:
            sock: paramiko.Channel | socket.socket
            if bastion.jumps:
                sock, release = self.tunnel(bastion)
            else:
                sock, release = open_socket(bastion), (lambda: None)
            try:
                client = open_client(bastion, sock)
            except BaseException:
                release()
                raise
        except ConnectFailed as exc:
            what, hint = describe(bastion, exc)
            raise BastionError(f"bastion {bastion.name} ({bastion.address}): {what}",
                               hint=hint) from None
        client.on_close = release
        return client

    def _release(self, key: HopKey) -> None:
        with self._lock:
            hop = self._hops[key]
            hop.users -= 1
            idle = self._sealed and hop.users == 0
        if idle and hop.client is not None:
            hop.client.close()

    def seal(self) -> None:
        """No more hosts will come: close the bastions that no host uses."""
        with self._lock:
            self._sealed = True
            idle = [h for h in self._hops.values() if h.users == 0 and h.client is not None]
        for hop in reversed(idle):  # a later hop may ride on an earlier one
            if hop.client is not None:
                hop.client.close()


# ---------------------------------------------------------------- every host

def connect(host: Host, config: paramiko.SSHConfig, base_dir: Path,
            bastions: Bastions | None = None, hosts: int = 1) -> Transport:
    """One host's connection; `bastions` shares bastion connections between hosts;
    `hosts`: how many the command connects to (each one's keepalive period and window)."""
    if host.connection == "local":
        return LocalTransport(host, cwd=str(base_dir))
    target = replace(resolve_target(host, config), keepalive=timeouts.keepalive(hosts),
                     window=window(hosts))
    own = bastions is None
    hops = Bastions() if bastions is None else bastions
    try:
        return connect_ssh(host, target, hops)
    except BastionError as exc:
        raise HostError(f"{host.label}: via {exc.message}", hint=exc.hint) from None
    except OrchError:
        raise
    except Exception as exc:  # every failure becomes a per-host message
        raise explain(host, target, exc) from None
    finally:
        if own:
            hops.seal()


def explain_failure(host: Host, exc: BaseException) -> BaseException:
    """A host's failure as the fan-out reports it: a connection lost meanwhile (or an error
    that is not orch's own) is told as the lost connection, with its fix."""
    lost = connection_error(host)
    if lost is not None or not isinstance(exc, OrchError):
        return explain_lost(host, lost or exc)
    return exc


explain_failures_with(explain_failure)
