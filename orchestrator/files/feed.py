"""One host's shard files, listed chunk by chunk by whichever thread needs the next one:
a first push starts with the first chunk instead of after the last.

At 100,000 files the listing (a link read and a check per file) took as long as the
push after it, and the host sat idle through it. Listing in one thread while pushing in
another did not help: the two took turns on the interpreter lock at every system call
and each ran at half speed. So the list is made lazily, from one generator (`source`)
that any thread may advance, one at a time (`making`): the listing thread runs ahead
while the hosts are connected to, and once a push takes the files (`each`) it makes the
rest itself, between its own sends, and the listing thread leaves it alone (`claimed`).
Whatever needs the whole list (a manifest to compare, hosts sharing a folder) makes
what is left of it (`whole`).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Callable

from orchestrator.errors import DataError
from orchestrator.files.localfiles import LocalFile


class Feed:
    def __init__(self, nbytes: int, source: Iterator[list[LocalFile]]) -> None:
        self.nbytes = nbytes   # the split's bytes of this host's shards: a progress bar's total
        self.source = source
        self.making = threading.Lock()
        self.chunks: list[list[LocalFile]] = []   # appended under `making`, read without
        self.done = False   # the source is exhausted (or failed): no chunk comes after these
        self.error: BaseException | None = None
        # a file not hashed yet was listed: no manifest token can stand for the list
        self.deferred = False
        self.claimed = False   # a push takes the files as they come, and lists the rest
        self.files: list[LocalFile] | None = None

    def advance(self) -> bool:
        """One more chunk listed; False once the list is complete (or failed: the
        thread whose listing failed gets the error raised, the others see `error`)."""
        with self.making:
            if self.done:
                return False
            try:
                chunk = next(self.source)
            except StopIteration:
                self.done = True
                return False
            except BaseException as e:
                self.error, self.done = e, True
                raise
            self.deferred = self.deferred or any(not f.digest for f in chunk)
            self.chunks.append(chunk)
            return True

    def run_ahead(self) -> None:
        """The listing thread's part: chunks made until a push takes over."""
        while not self.claimed and self.advance():
            pass

    def whole(self) -> list[LocalFile]:
        """The complete list (the rest listed here); the listing's error if it failed."""
        while self.advance():
            pass
        self._raise()
        with self.making:
            if self.files is None:
                self.files = [f for chunk in self.chunks for f in chunk]
            return self.files

    def known(self) -> list[LocalFile] | None:
        """The whole list when it can stand for a manifest token (every file hashed),
        else None, as soon as a file listed unhashed says so."""
        while not self.deferred and self.advance():
            pass
        return None if self.deferred else self.whole()

    def empty(self) -> bool:
        """True when the list is complete and holds no file."""
        while not self.chunks and self.advance():
            pass
        self._raise()
        return not self.chunks

    def each(self, arrived: Callable[[], None] | None = None) -> Iterator[LocalFile]:
        """The files in listing order; the listing thread stops and the rest is listed
        here, chunk by chunk. `arrived` is called before each chunk's files (a push's
        stall watchdog counts listing as progress). A listing that fails ends the files
        with its error, as a DataError: the push sends what came before and stops cleanly."""
        self.claimed = True
        taken = 0
        while True:
            if taken < len(self.chunks):
                taken += 1
                if arrived is not None:
                    arrived()
                yield from self.chunks[taken - 1]
            elif not self.advance() and taken == len(self.chunks):
                break
        self._raise(DataError)

    def _raise(self, kind: type[Exception] | None = None) -> None:
        if self.error is None:
            return
        if kind is None or isinstance(self.error, kind):
            raise self.error
        raise DataError(f"listing the local files failed: {self.error}")
