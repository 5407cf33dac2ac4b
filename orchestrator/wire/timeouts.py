"""Every timeout and grace period of orch, controller and agent, in one place (seconds).

The agent's bundle carries this module too (stdlib only, Python 3.8).
"""
from __future__ import annotations

import math
import threading
import time

KEEPALIVE = 5.0             # SSH keepalive on an idle connection, the shortest (keepalive(hosts))
KEEPALIVE_MAX = 15.0        # ... and the longest: an idle connection still sends a packet
                            # within twice this, under the shortest NAT/firewall idle timeouts (60 s)
KEEPALIVE_RATE = 100.0      # keepalive wake-ups a second the controller takes for all hosts together
AGENT_START = 60.0          # from opening the session to the agent's hello (login shell, python)
PREFLIGHT = 60.0            # preflight's reply (at least 3x ssh.connect_timeout)
# ... plus this per host of the command: every login's handshake runs on this machine's
# CPU, and on a loaded one 128 logins of a heavy shell took 70 s (pdsh waits as long)
PER_HOST = 0.5
SYNC = 600.0                # one host's push (the reply after the last byte)
PUSH_IDLE = 20.0            # a push: no byte taken by the host and no frame from it for this
                            # long (sshd frozen, link cut): the host is lost, the push ends
LAUNCH = 60.0               # the supervisor's pid after the spec was sent
STATUS = 30.0               # `orch status`
ERROR_FILE = 15.0           # fetching torchrun's error file for the root cause
STOP_EXTRA = 60.0           # a stop's reply may take its grace period plus this
HOST_LOST = 15.0            # no frame (not even a heartbeat) for this long: the host is lost
                            # (with HEARTBEAT's period; more past 100 hosts: host_lost())
LOST_BEATS = 5.0            # ... and each second the period grew past HEARTBEAT adds this much
FAILFAST_GRACE = 3.0        # SIGTERM -> SIGKILL when a rank failed
INTERRUPT_GRACE = 10.0      # SIGTERM -> SIGKILL after Ctrl-C
STOP_GRACE = 10.0           # `orch stop`'s default --grace
DRAIN = 5.0                 # after a stop: how long the last lines and exit codes may take
CLOSE = 1.0             # waiting for an agent to end after its stdin was closed
LAST_LOOKS = 30.0           # at a run's end: the curves' last looks at the hosts let go
OPEN_SESSION = 30.0          # opening one SSH session (exec channel)
PULL_MANIFEST = 600.0       # a pull's manifest (the host may hash big new checkpoints)
PULL_IDLE = 60.0            # a pull's stream: no frame for this long and the host is lost
PULL_AGE = 15.0             # after a pull: the host lists the files older than the run (a note)
CLOCK_REPLY = 2.0           # a `clock` sample's reply; a later one is not a useful sample
CLOCK_FIRST = 2.0           # the first clock samples of a followed job, after its start
                            # (later past 100 hosts: clock_first())
CLOCK_BURST = 500           # clock requests the first samples send in all, at most 5 each
CLOCK_PERIOD = 5.0          # a new clock sample per host this often while a job is watched
                            # (slower past 100 hosts: clock_period())
SETUP = 6 * 3600.0          # one host's `setup:` (pip installs can be long)
STACKS = 15.0               # a hang: the hosts' `stacks` replies (each waits STACK_WAIT at most)
CANCEL = 15.0               # Ctrl-C during setup or exec: the hosts' replies after a cancel
NET_WAITS = 10.0            # a look for a network hang: the hosts' `net_waits` replies

# on the host (the agent)
HEARTBEAT = 1.0             # a follow's heartbeat period, the shortest (heartbeat(hosts))
HEARTBEAT_MAX = 10.0        # ... and the longest, asked of a large job's hosts
HEARTBEAT_RATE = 100.0      # heartbeats a second the controller takes from all hosts together
STACK_WAIT = 3.0            # a hang: how long the ranks have to write their stacks
HEARTBEAT_POLL = 1.0        # how often a follow looks at the ranks' heartbeat files
STOP_VERIFY = 5.0           # after SIGKILL: how long a stop waits for the kernel to reap
STOP_WORD_MARGIN = 1.0      # a stopping agent waits this much past its supervisor's last word
LEFTOVER_GRACE = 3.0        # the ranks ended by themselves: SIGTERM -> SIGKILL of what they left
NVIDIA_SMI = 20.0           # preflight's `nvidia-smi -L`
RECEIVE_IDLE = 30.0         # a receive stream: no byte from the controller for this long and
                            # the receiver keeps what landed and ends (its controller is gone)
RECEIVE_LOCK = RECEIVE_IDLE + 10.0   # a new push waits this long for such a receiver to end
PROBE = 60.0                # after setup: the configured python's torch and entrypoint check
COMMAND_DRAIN = 2.0         # setup/exec: output still read after the command ended (a background child)
COMMAND_GRACE = 3.0         # setup/exec cancelled: SIGTERM -> SIGKILL of its process group


def scaled(base: float, hosts: int) -> float:
    """A timeout that covers one host's step while `hosts` do the same at once."""
    return base + PER_HOST * max(0, hosts)


def heartbeat(hosts: int) -> float:
    """The heartbeat period a follow of `hosts` asks of each: every beat wakes the
    controller and is decrypted there only to learn nothing changed, so all of them
    together come at most HEARTBEAT_RATE times a second (1,000 hosts: every 10 s)."""
    return min(HEARTBEAT_MAX, max(HEARTBEAT, hosts / HEARTBEAT_RATE))


def keepalive(hosts: int) -> float:
    """How often each of `hosts` SSH connections wakes its transport thread, and sends a
    keepalive when nothing else went out meanwhile: whole seconds, all connections
    together at most KEEPALIVE_RATE wake-ups a second up to 1,500 hosts (1,000: every
    10 s). The keepalive only keeps an idle connection's NAT and firewall state and lets
    TCP see a dead peer; a lost host is found by the heartbeat (host_lost), not by it."""
    return min(KEEPALIVE_MAX, max(KEEPALIVE, float(math.ceil(hosts / KEEPALIVE_RATE))))


def host_lost(hosts: int) -> float:
    """How long a host of a follow of `hosts` may send nothing: HOST_LOST at the base
    period, then LOST_BEATS more for each second the period grew (25 s at 300 hosts,
    60 s at 1,000: five periods and more), so a slower beat is never mistaken for loss."""
    return HOST_LOST + LOST_BEATS * (heartbeat(hosts) - HEARTBEAT)


def clock_first(hosts: int) -> tuple[float, int]:
    """When a watched job's first clock samples are taken (seconds after its start) and
    how many rounds of them, back to back: 5 rounds after CLOCK_FIRST up to 100 hosts;
    past that later, as the heartbeat, and fewer, CLOCK_BURST requests in all (1,000
    hosts: one round after 20 s). Five rounds at once to 1,000 hosts were 5,000
    requests in the job's first seconds, while its ranks start on the hosts' cores (and
    a crash then is stopped beside them); a failure is judged with fresh samples of its
    own hosts anyway."""
    return CLOCK_FIRST * heartbeat(hosts) / HEARTBEAT, max(1, min(5, CLOCK_BURST // max(1, hosts)))


def clock_period(hosts: int) -> float:
    """How often a watched job's hosts are each asked for a clock sample: CLOCK_PERIOD,
    slower as the heartbeat (50 s at 1,000 hosts: 20 requests a second in all). Clocks
    drift by parts per million; a failure is judged with fresh samples anyway."""
    return CLOCK_PERIOD * heartbeat(hosts) / HEARTBEAT


class Clock:
    """What the controller's watchdogs (the push's stall, the follow's host-lost) read
    and wait on between checks: the monotonic clock. `CLOCK` is read at each watchdog's
    start, so a test can put a fake one there and test a timeout without its wait."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(seconds)


CLOCK = Clock()
