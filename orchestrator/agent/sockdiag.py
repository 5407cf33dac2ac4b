"""This network namespace's TCP sockets in one state, asked of the kernel's sock_diag
netlink (what `ss state syn-sent` asks) instead of read from /proc/net/tcp.

/proc/net/tcp formats every socket of the namespace as text: 24 ms of CPU for 5,000
sockets, paid by every host's agent at each network look (`net_waits`), where most
sockets are the machine's own (a fake cluster's thousand sshds share one namespace; a
busy server has as many). The kernel filters a sock_diag dump by state before anything
is written, so a look for the few connections that wait costs well under a millisecond.
Standard library only (struct), as everything the agent runs on a host."""
from __future__ import annotations

import _socket
import struct

TCP_SYN_SENT = 2            # the kernel's state number (include/net/tcp_states.h)
MAX_SOCKETS = 65536         # answers read from one dump at most: a look stays bounded

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_HDR = struct.Struct("=IHHII")               # nlmsghdr: len, type, flags, seq, pid
_REQ = struct.Struct("=BBBBI48x")            # inet_diag_req_v2, its socket id left zero
# inet_diag_msg: family, state, timer, retrans; id (sport, dport big-endian, src, dst,
# interface, cookie); expires, rqueue, wqueue, uid, inode
_MSG = struct.Struct("=BBBB2s2s16s16s4x8xIIIII")

Socket = tuple[int, str, str, int, int]   # inode, local address, remote address, port, retransmits


def sockets(state: int) -> list[Socket] | None:
    """The namespace's TCP sockets (IPv4 and IPv6) in `state`: (inode, local address,
    remote address, remote port, times the kernel sent the SYN or data again). None where
    the kernel answers no sock_diag (not built in, a sandbox): the caller reads /proc."""
    out: list[Socket] = []
    for family in (_socket.AF_INET, _socket.AF_INET6):
        try:
            sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        except (OSError, AttributeError):
            return None
        try:   # a socket per dump: one cut at MAX_SOCKETS leaves no answer to the next
            sock.settimeout(2.0)
            if not dump(sock, family, state, out):
                return None
        except OSError:
            return None
        finally:
            sock.close()
    return out


def dump(sock: _socket.socket, family: int, state: int, out: list[Socket]) -> bool:
    """One family's dump appended to out; False on an error answer."""
    req = _REQ.pack(family, _socket.IPPROTO_TCP, 0, 0, 1 << state)
    sock.send(_HDR.pack(_HDR.size + len(req), _SOCK_DIAG_BY_FAMILY,
                        _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req)
    seen = 0
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return False
        for kind, body in messages(data):
            seen += 1
            if kind == _NLMSG_DONE or seen > MAX_SOCKETS:
                return True
            if kind == _NLMSG_ERROR:
                return False
            got = parse(body)
            if got is not None:
                out.append(got)


def messages(data: bytes) -> list[tuple[int, bytes]]:
    """The netlink messages of one datagram: (type, body)."""
    out, pos = [], 0
    while pos + _HDR.size <= len(data):
        length, kind = _HDR.unpack_from(data, pos)[:2]
        if length < _HDR.size or pos + length > len(data):
            break
        out.append((kind, data[pos + _HDR.size:pos + length]))
        pos += (length + 3) & ~3
    return out


def parse(body: bytes) -> Socket | None:
    """One inet_diag_msg as a Socket; None when short."""
    if len(body) < _MSG.size:
        return None
    family, _, _, retrans, _, dport, src, dst, _, _, _, _, inode = _MSG.unpack_from(body)
    return (inode, address(family, src), address(family, dst),
            int.from_bytes(dport, "big"), retrans)


def address(family: int, raw: bytes) -> str:
    """An address as /proc's reader gives it: IPv4 dotted, an IPv4-mapped IPv6 one too."""
    if family == _socket.AF_INET:
        return _socket.inet_ntop(_socket.AF_INET, raw[:4])
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return _socket.inet_ntop(_socket.AF_INET, raw[12:])
    return _socket.inet_ntop(_socket.AF_INET6, raw)
