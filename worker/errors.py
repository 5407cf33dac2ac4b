"""The worker's user-facing error, printed as one line per rank instead of a traceback."""
from __future__ import annotations

try:
    from orchestrator.errors import OrchError as _Base
except ImportError:  # a host may receive only worker/ (code.paths), not the orchestrator

    class _Base(Exception):  # type: ignore[no-redef]
        exit_code = 2

        def __init__(self, message: str, *, hint: str = "") -> None:
            super().__init__(message)
            self.message = message
            self.hint = hint


class WorkerError(_Base):
    """A mistake the user can fix (data layout, options, checkpoint): exit code 2."""

    exit_code = 2

    def one_line(self) -> str:
        message = self.message
        if "\nOriginal Traceback" in message:
            # Raised in a DataLoader worker: torch re-raises it with the worker's traceback
            # folded into the message; the user needs only the last line.
            message = message.rstrip().splitlines()[-1].split("WorkerError: ", 1)[-1]
        return f"{message} (fix: {self.hint})" if self.hint else message
