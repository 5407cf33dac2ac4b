"""IndexedHostKeys (ssh/knownhosts.py) finds what paramiko's HostKeys finds, without a
scan of every line per name."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import paramiko
import pytest

from orchestrator.ssh.knownhosts import IndexedHostKeys

KEYS = [paramiko.ECDSAKey.generate(bits=b) for b in (256, 384, 521, 256)]


def found(keys: paramiko.HostKeys, name: str) -> dict[str, bytes]:
    got = keys.lookup(name)
    return {t: k.asbytes() for t, k in got.items()} if got is not None else {}


def lines(keys: paramiko.HostKeys) -> list[str]:
    return [e.to_line() for e in getattr(keys, "_entries")]   # noqa: B009 (untyped)


def known_hosts(path: Path, seed: int) -> list[str]:
    """A file of plain and hashed names, several names to a line, names repeated with
    another key type or the same (the first line of a type wins), a comment, a blank."""
    rng = random.Random(seed)
    names = [f"10.0.{seed}.{i}" for i in range(12)] + [f"[host{i}]:2222" for i in range(6)]
    lines = ["# a comment", ""]
    for _ in range(40):
        picked = rng.sample(names, rng.choice((1, 1, 2)))
        shown = [paramiko.HostKeys.hash_host(n) if rng.random() < 0.3 else n for n in picked]
        key = rng.choice(KEYS)
        lines.append(f"{','.join(shown)} {key.get_name()} {key.get_base64()}")
    path.write_text("\n".join(lines) + "\n")
    return names + ["10.9.9.9", "[10.0.0.1]:22"]


@pytest.mark.parametrize("seed", range(4))
def test_lookup_finds_what_paramiko_finds(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "known_hosts"
    names = known_hosts(path, seed)
    ours, theirs = IndexedHostKeys(str(path)), paramiko.HostKeys(str(path))
    assert lines(ours) == lines(theirs)
    # a hashed name asked as written, too
    names += [n for e in getattr(theirs, "_entries") for n in e.hostnames if n.startswith("|1|")]  # noqa: B009
    for name in names:
        assert found(ours, name) == found(theirs, name), name
        mine, paramikos = ours.lookup(name), theirs.lookup(name)
        if mine is not None and paramikos is not None:   # the client asks for keys()[0]
            assert mine.keys()[0] == paramikos.keys()[0]
        for key in KEYS:
            assert ours.check(name, key) == theirs.check(name, key), name


def test_added_keys_are_found_and_replace_the_same_type(tmp_path: Path) -> None:
    path = tmp_path / "known_hosts"
    path.write_text(f"a {KEYS[0].get_name()} {KEYS[0].get_base64()}\n")
    keys = IndexedHostKeys(str(path))
    assert keys.lookup("b") is None
    keys.add("b", KEYS[1].get_name(), KEYS[1])   # accept-new's record
    assert found(keys, "b") == {KEYS[1].get_name(): KEYS[1].asbytes()}
    keys.add("a", KEYS[3].get_name(), KEYS[3])   # the same type as a's: replaced
    assert found(keys, "a") == {KEYS[3].get_name(): KEYS[3].asbytes()}
    assert len(lines(keys)) == 2
    keys.clear()
    assert keys.lookup("a") is None and keys.lookup("b") is None


def test_plain_names_are_found_without_a_scan(tmp_path: Path) -> None:
    """A 2,000-line file, every name looked up: no line is compared one by one (paramiko
    compares each name with every line, 4 million comparisons here)."""
    key = KEYS[0]
    path = tmp_path / "known_hosts"
    names = [f"[10.1.{i // 250}.{i % 250}]:22" for i in range(2000)]
    path.write_text("".join(f"{n} {key.get_name()} {key.get_base64()}\n" for n in names))
    calls: list[str] = []

    class Counted(IndexedHostKeys):   # a subclass, not a patch other threads would see
        def _hostname_matches(self, hostname: str, entry: Any) -> bool:
            calls.append(hostname)
            return bool(super()._hostname_matches(hostname, entry))
    keys = Counted(str(path))
    assert all(keys.check(n, key) for n in names)
    assert calls == []
    hashed = tmp_path / "hashed"   # a hashed line is compared: the count sees it
    hashed.write_text(f"{paramiko.HostKeys.hash_host('x')} {key.get_name()} {key.get_base64()}\n")
    assert Counted(str(hashed)).lookup("x") is not None and calls == ["x"]
