"""tools/check_lock.py: what makes `make install` prove the venv holds exactly the lock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_lock", ROOT / "tools" / "check_lock.py")
assert _spec and _spec.loader
check_lock = importlib.util.module_from_spec(_spec)
sys.modules["check_lock"] = check_lock
_spec.loader.exec_module(check_lock)


def test_lock_pins_parsed_in_canonical_form(tmp_path: Path) -> None:
    lock = tmp_path / "requirements.lock"
    lock.write_text("# header\nPyYAML==6.0.4   # via orch\ntypes_paramiko==5.1.0.1\n\n--find-links x\n")
    assert check_lock.locked(lock) == {"pyyaml": "6.0.4", "types-paramiko": "5.1.0.1"}


def test_every_difference_named() -> None:
    found = check_lock.differences({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "9", "d": "4"})
    assert found == ["b: 9 installed, 2 locked", "missing: c==3", "not in the lock: d==4"]


def test_the_repository_venv_is_exactly_the_lock() -> None:
    lock = check_lock.locked(ROOT / "requirements.lock")
    assert {"pyyaml", "paramiko", "torch", "pip", "setuptools"} <= lock.keys()
    assert check_lock.differences(lock, check_lock.installed()) == []
