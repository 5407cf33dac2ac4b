"""wire/jsonc: the agent's JSON gives what `json` gives, on every Python the agent runs on;
the curves' globs match as fnmatch matches; and an agent's start, a follow, a status, a
stop, the curves' pull and the supervisor load neither `json` nor `re`, `typing`, `enum`."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.wire import globs, jsonc

ROOT = Path(__file__).resolve().parent.parent

scalars = (st.none() | st.booleans() | st.integers() | st.text()
           | st.floats(allow_nan=True, allow_infinity=True))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(st.text(), kids, max_size=4), max_leaves=20)


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN, -0.0 told from 0.0 (repr keeps both apart)."""
    return repr(a) == repr(b) or (isinstance(a, float) and isinstance(b, float)
                                  and math.isnan(a) and math.isnan(b))


@settings(max_examples=300, deadline=None)
@given(values)
def test_dumps_writes_the_bytes_json_writes(value: object) -> None:
    assert jsonc.dumps(value) == json.dumps(value)
    assert jsonc.dumps(value, separators=(",", ":")) == json.dumps(value, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from(["", " ", "\n", " \t\r\n"]))
def test_loads_reads_what_json_reads(value: object, pad: str) -> None:
    text = pad + json.dumps(value) + pad
    assert repr(jsonc.loads(text)) == repr(json.loads(text)) or same(
        jsonc.loads(text), json.loads(text))


@settings(max_examples=200, deadline=None)
@given(values, st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-32-le"]))
def test_loads_reads_bytes_as_json_reads_them(value: object, encoding: str) -> None:
    data = json.dumps(value, ensure_ascii=False).encode(encoding, "surrogatepass")
    assert same(jsonc.loads(data), json.loads(data)) or repr(jsonc.loads(data)) == repr(
        json.loads(data))


@pytest.mark.parametrize("bad", ["", "  ", "{", "[1,]", "1 2", "nul", '"\x01"', '{"a" 1}',
                                 "[1] x", '"\\x"', "{'a': 1}", "\ufeff1"])
def test_loads_refuses_what_json_refuses(bad: str) -> None:
    with pytest.raises(ValueError):
        json.loads(bad)
    with pytest.raises(ValueError):
        jsonc.loads(bad)


def test_dumps_refuses_what_json_refuses() -> None:
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        jsonc.dumps(loop)
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonc.dumps({"a": object()})
    with pytest.raises(TypeError):
        jsonc.dumps({(1, 2): 1})


def test_the_c_codec_is_the_one_in_use() -> None:
    """Else every test above compares json with itself."""
    assert jsonc._C is not None


CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
from orchestrator.wire import globs, jsonc
assert jsonc._C is not None, "no C codec"
assert "re" not in sys.modules, "re loaded"
import json
for v in [{"a": [1, 2.5, float("nan"), "\\u00e9\\x00\\ud800", None, True]}, "x\\u2028", 1e300,
          {"k": {"n": -0.0}}, 10 ** 30, []]:
    assert jsonc.dumps(v) == json.dumps(v), v
    assert repr(jsonc.loads(" " + json.dumps(v) + "\\n")) == repr(json.loads(json.dumps(v)))
for bad in ["", "[1,]", "1 2", '"\\x01"']:
    try:
        jsonc.loads(bad)
    except ValueError:
        continue
    raise AssertionError("not refused: %r" % bad)
print("ok")
"""


def interpreters() -> list[str]:
    """Every CPython 3.8+ on this machine (pyenv's, the system's)."""
    found = glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))
    found += glob.glob("/usr/bin/python3.[0-9]*")
    minor = [re.search(r"3\.(\d+)", p) for p in found]
    return sorted({p for p, m in zip(found, minor) if m and int(m.group(1)) >= 8
                   and not p.endswith("-config") and os.access(p, os.X_OK)})


@pytest.mark.parametrize("python", interpreters() or [sys.executable])
def test_the_codec_on_every_python_the_agent_runs_on(python: str) -> None:
    got = subprocess.run([python, "-S", "-c", CHECK, str(ROOT)], capture_output=True,
                         text=True, timeout=60)
    assert got.stdout.strip() == "ok", got.stderr


START = """
import sys
sys.path.insert(0, sys.argv[1])
import orchestrator.agent.main
for m in ("preflight", "status", "follow", "launch", "procs", "supervisor", "stacks"):
    __import__("orchestrator.agent." + m)
# what a preflight loads before its prewarm forks the job's supervisor
assert "orchestrator.agent.files" not in sys.modules, "files.py (hashlib) before the prewarm"
assert sys.modules["orchestrator.agent.preflight"].torch_version() is not None
__import__("orchestrator.agent.pull")
from orchestrator.wire import globs, jsonc
assert globs.matches_any(["**/metrics*.csv", "**/*.jsonl"], "a/b/metrics-0.csv")
assert jsonc.loads(b'{"go": [1]}') == {"go": [1]}   # the warm start's pipes carry bytes
print(" ".join(sorted(m for m in ("re", "enum", "json", "typing", "shlex", "fnmatch", "signal",
                                   "subprocess") if m in sys.modules)))
"""


def test_the_agent_start_loads_no_re_enum_or_json() -> None:
    """The modules of a preflight (up to the prewarm, which forks the job's supervisor),
    a status, a follow, a launch, a stop, the curves' pull and the supervisor: `re` and
    `enum` are about 1.2 MiB and 8-10 ms in each agent and supervisor on every host,
    `typing` 11 ms more."""
    got = subprocess.run([sys.executable, "-S", "-c", START, str(ROOT)], capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == ""


@settings(max_examples=1000, deadline=None)
@given(st.text("ab*?.", max_size=8), st.text("ab.\n", max_size=10))
def test_a_star_pattern_matches_what_fnmatch_matches(pattern: str, name: str) -> None:
    """wire/globs.star_match: the curves' globs matched without `re`."""
    import fnmatch
    assert globs.star_match(pattern, name) == fnmatch.fnmatchcase(name, pattern)


def test_torchs_dist_info_found_as_glob_finds_it(tmp_path: Path) -> None:
    """agent/preflight.dist_infos: glob.glob's answer for `torch-*.dist-info`, without
    glob's `re` in the agent (and in the supervisor it forks)."""
    from orchestrator.agent import preflight
    for name in ("torch-2.14.1.dist-info", "torch-1.0.dist-info", "torchvision-0.29.dist-info",
                 "torch-2.0.egg-info", "torch.dist-info", "xtorch-1.dist-info", "[torch-3.dist-info"):
        (tmp_path / name).mkdir()
    folder = tmp_path / "a [b]"   # glob would read the brackets as a pattern
    folder.mkdir()
    (folder / "torch-9.dist-info").mkdir()
    want = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "torch-*.dist-info")))
    assert preflight.dist_infos(str(tmp_path), "torch") == want == [
        "torch-1.0.dist-info", "torch-2.14.1.dist-info"]
    assert preflight.dist_infos(str(folder), "torch") == ["torch-9.dist-info"]
    assert preflight.dist_infos(str(tmp_path / "missing"), "torch") == []
