"""invoke, imported by paramiko at its own import for one rare ssh_config feature.

paramiko.config imports `invoke` eagerly, only to run `Match exec` commands; invoke's
own imports (asyncio, unittest.mock...) cost 30-50 ms at every `orch` start, before the
first host is contacted. So paramiko is imported without it (`hold_back` before any
paramiko import), and `give_back` imports it for real and hands it to paramiko when an
SSH config may need it (sshconfig.ssh_config: one that mentions `exec` or `Include`)."""
from __future__ import annotations

import sys

NAME = "invoke"


def hold_back() -> None:
    """paramiko, imported after this, sees no invoke (as if it were not installed)."""
    if NAME not in sys.modules:
        sys.modules[NAME] = None  # type: ignore[assignment]


def give_back() -> None:
    """The real invoke for paramiko's `Match exec` (when installed)."""
    if sys.modules.get(NAME, "") is None:
        del sys.modules[NAME]
    try:
        import invoke  # noqa: F401  (what paramiko runs `Match exec` commands with)
    except ImportError:
        return
    config = sys.modules.get("paramiko.config")
    if config is not None and getattr(config, "invoke", None) is None:
        config.invoke = sys.modules[NAME]  # type: ignore[attr-defined]
