"""known_hosts with a lookup by name instead of a scan of every line.

paramiko's `HostKeys.lookup` compares the name with every line, and so does its `load`
for every line it reads (to drop a name already known with that key): each host's
connect scanned the whole file, O(hosts x lines) of CPU for one command, and the load
O(lines^2). Here names go through a dict, as written; a hashed line
(`|1|salt|hash`, OpenSSH's HashKnownHosts) can only be told by hashing the name with its
salt, so those lines are still tried one by one, as paramiko does.

Lines are only ever appended (load, add, accept-new), so the index grows with them; a
list replaced or cut (`clear`, a direct edit) is indexed again from its start.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import paramiko


class FoundKeys(Mapping[str, paramiko.PKey]):
    """One host's keys, read only, as paramiko's lookup gives them: `keys()` a list in
    the file's order (paramiko's client takes `keys()[0]` as the type to ask for)."""

    def __init__(self, keys: dict[str, paramiko.PKey]) -> None:
        self._keys = keys

    def __getitem__(self, keytype: str) -> paramiko.PKey:
        return self._keys[keytype]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[str]:  # type: ignore[override]
        return list(self._keys)


class IndexedHostKeys(paramiko.HostKeys):
    # paramiko's own, untyped in its stubs
    _entries: list[Any]
    _hostname_matches: Callable[[str, Any], bool]

    def __init__(self, filename: str | None = None) -> None:
        self._by_name: dict[str, list[int]] = {}
        self._hashed: list[int] = []
        self._seen: tuple[int, int] = (0, 0)   # (id of the indexed list, lines indexed)
        super().__init__(filename)

    def _index(self) -> None:
        """Index the lines added since the last look (all of them for a new list)."""
        entries: list[Any] = self._entries
        listed, done = self._seen
        if listed != id(entries) or done > len(entries):
            self._by_name, self._hashed, done = {}, [], 0
        for i in range(done, len(entries)):
            for name in entries[i].hostnames:
                # by its very text too: paramiko matches a hashed name asked as written
                self._by_name.setdefault(name, []).append(i)
                if name.startswith("|1|"):
                    self._hashed.append(i)
        self._seen = (id(entries), len(entries))

    def _lines_of(self, hostname: str) -> list[Any]:
        """The lines naming hostname, in the file's order (the first of a key type wins)."""
        self._index()
        found = set(self._by_name.get(hostname, ()))
        if not hostname.startswith("|1|"):
            found.update(i for i in self._hashed
                         if self._hostname_matches(hostname, self._entries[i]))
        return [self._entries[i] for i in sorted(found)]

    def lookup(self, hostname: str) -> FoundKeys | None:  # type: ignore[override]
        """{key type: key} of the lines naming hostname (the first line of a type), or
        None; read only: keys are added with `add`, which keeps the index."""
        keys: dict[str, paramiko.PKey] = {}
        for e in self._lines_of(hostname):
            if e.key is not None:
                keys.setdefault(e.key.get_name(), e.key)
        return FoundKeys(keys) if keys else None

    def add(self, hostname: str, keytype: str, key: paramiko.PKey) -> None:
        """As paramiko's: the key of a line with this very name (not a hashed one) is
        replaced, or a line appended."""
        self._index()
        for i in self._by_name.get(hostname, ()):
            e = self._entries[i]
            if e.key is not None and e.key.get_name() == keytype:
                e.key = key
                return
        self._entries.append(paramiko.hostkeys.HostKeyEntry([hostname], key))
