"""Where to connect: each host of the inventory as a `Target`, with ~/.ssh/config.

The inventory wins over ~/.ssh/config (or ORCH_SSH_CONFIG), which wins over the
defaults, as `ssh -o` does: HostName, Port, User, IdentityFile and ProxyJump are read
from it, each bastion of a chain with its own entry. A config that exists but cannot
be used is exit 2, naming its line where paramiko does not. A config that may run
commands (`Match exec`, or an `Include` that may hold one) gets paramiko's invoke back
first (lazyimport.py).
"""
from __future__ import annotations

import getpass
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.config.inventory import Host
from orchestrator.config.proxyjump import parse_chain
from orchestrator.errors import UsageError
from orchestrator.ssh import lazyimport
from orchestrator.ssh.target import Target


def ssh_config_path() -> str:
    return os.environ.get("ORCH_SSH_CONFIG", os.path.expanduser("~/.ssh/config"))


def ssh_config() -> paramiko.SSHConfig:
    """~/.ssh/config (or ORCH_SSH_CONFIG); a file that exists but cannot be used is exit 2."""
    path = ssh_config_path()
    if not path or not os.path.exists(path) or path == os.devnull:
        return paramiko.SSHConfig()
    try:
        if may_run_commands(path):
            lazyimport.give_back()
        return paramiko.SSHConfig.from_path(path)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the SSH config: {exc.strerror or exc}",
                         hint=f"make it readable (chmod 600 {path}), or point ORCH_SSH_CONFIG "
                              "at another file") from None
    except Exception as exc:  # paramiko.ConfigParseError and what its parser trips on
        raise _config_error(path, exc) from None


def may_run_commands(path: str) -> bool:
    """The config has a `Match exec` (run with invoke), or includes files that may."""
    with open(path, "rb") as f:
        text = f.read().lower()
    return b"exec" in text or b"include" in text


def _config_error(path: str, exc: BaseException) -> UsageError:
    where = path
    text = str(exc)
    if text.startswith("Unparsable line "):  # paramiko does not say which line: find it
        bad = text[len("Unparsable line "):].strip()
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
            found = [n for n, line in enumerate(lines, 1) if line.strip() == bad]
            where += f":{found[0]}" if found else ""
        except OSError:
            pass
    return UsageError(f"{where}: the SSH config cannot be used: {text}",
                      hint=f"fix that line of {path} (`ssh -G HOST -F {path}` shows what OpenSSH "
                           "makes of it), or point ORCH_SSH_CONFIG at another file")


def _lookup(config: paramiko.SSHConfig, name: str) -> paramiko.SSHConfigDict:
    try:
        return config.lookup(name)
    except Exception as exc:  # a Match block paramiko cannot evaluate, and the like
        raise _config_error(ssh_config_path(), exc) from None


def _config_keys(entry: paramiko.SSHConfigDict) -> tuple[str, ...]:
    # OpenSSH skips an IdentityFile that does not exist; so do we
    paths = (os.path.expanduser(p) for p in entry.get("identityfile", []))
    return tuple(p for p in paths if os.path.exists(p))


def resolve_target(host: Host, config: paramiko.SSHConfig) -> Target:
    """The inventory wins over ~/.ssh/config, which wins over the defaults (as `ssh -o`)."""
    entry = _lookup(config, host.address)
    opts = host.ssh
    identities = (opts.identity_file,) if opts.identity_file else _config_keys(entry)
    target = Target(
        hostname=entry.get("hostname", host.address),
        port=opts.port or int(entry.get("port", 22)),
        user=opts.user or entry.get("user") or getpass.getuser(),
        identity_files=identities,
        known_hosts=opts.known_hosts,
        policy=opts.host_key_policy,
        timeout=opts.connect_timeout,
        name=host.label,
    )
    chain = opts.proxy_jump if opts.proxy_jump is not None else entry.get("proxyjump", "none")
    return replace(target, jumps=_resolve_jumps(host, chain, config, target))


def _resolve_jumps(host: Host, chain: Any, config: paramiko.SSHConfig,
                   base: Target) -> tuple[Target, ...]:
    """Each bastion: what `proxy_jump` says, then its own ~/.ssh/config entry, then the
    host's user and keys; known_hosts, policy and timeout are always the host's."""
    try:
        jumps = parse_chain(chain)
    except ValueError as exc:  # only ~/.ssh/config's ProxyJump gets here: the inventory checks
        raise UsageError(f"{host.label}: ProxyJump in the SSH config: {exc}",
                         hint="write ProxyJump as [user@]host[:port], several separated by commas"
                         ) from exc
    targets = []
    for jump in jumps:
        entry = _lookup(config, jump.host)
        targets.append(replace(
            base, hostname=entry.get("hostname", jump.host),
            port=jump.port or int(entry.get("port", 22)),
            user=jump.user or entry.get("user") or base.user,
            identity_files=_config_keys(entry) or base.identity_files, name=str(jump)))
    return tuple(targets)
