"""Fuzzing the inventory reader: whatever the file holds, `parse` ends in a Cluster or in
one InventoryError (exit 2, `file:LINE:` with a line inside the file, a fix), never in
another exception, within 2 s and 200 MB per document.

Three generators, 1,500 documents in all (375 in `make test-fast`): valid inventories with parts replaced by
random YAML values (dumped with anchors and aliases where values are shared), valid
inventories mutated as text (nasty snippets, random characters, lines moved), and
anchor/merge-key chains of random shape (the billion-laughs family). Runs are
derandomized so that CI sees the same documents every time.
"""
from __future__ import annotations

import copy
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.config.hostspec import MAX_HOSTS, MAX_WORLD_SIZE
from orchestrator.config.inventory import Cluster, parse
from orchestrator.errors import InventoryError

MAX_SECONDS = 2.0
DUMPER = getattr(yaml, "CDumper", yaml.Dumper)   # PyYAML without libyaml: the Python one
MAX_BYTES = 200 << 20

VALID: dict[str, Any] = {
    "name": "fuzz",
    "ssh": {"user": "ubuntu", "port": 22, "host_key_policy": "strict", "connect_timeout": 10},
    "hosts": [
        {"address": "10.0.0.8", "gpus": 2},
        {"address": "gpu[01-04]", "procs": 1, "port": 2222},
        "node7",
    ],
    "remote_dir": "~/orch",
    "python": "python3",
    "code": {"paths": ["worker"], "exclude": ["*.pyc"]},
    "data": {"source": "data/src", "shards": "data/shards"},
    "job": {"entrypoint": "worker.train", "args": ["--epochs", "5"], "env": {"NCCL_DEBUG": "WARN"},
            "master_port": 29500, "max_restarts": 0},
}
LOCAL = "name: demo\nhosts:\n  - address: localhost\n    connection: local\njob:\n  entrypoint: worker.train\n"
SEEDS = [yaml.safe_dump(VALID, sort_keys=False), yaml.safe_dump(VALID, default_flow_style=True), LOCAL,
         "x-box: &box {gpus: 1, python: /venv/bin/python}\nname: a\nhosts:\n  - <<: *box\n    address: a\n"
         "  - {<<: *box, address: 'b[1-3]'}\njob: {entrypoint: job/train.py, args: --lr 0.1}\n"]

# Text that YAML or orch treats specially, for the text mutations.
SNIPPETS = [
    "<<: *a", "&a", "*a", "&a {gpus: 1}", "<<: [*a, *a]", "!!binary aGk=", "!!python/object:os.system",
    "!!timestamp 2024-13-45", "!!int x", "!!float y", "!!bool maybe", "!!set {a}", "!!omap [a: 1]",
    "9" * 5000, "1e400", "-.inf", ".nan", "0x" + "f" * 40, "0o777", "1_000", "~", "null", "yes", "'",
    '"', "\\0", '"\\0"', '"\\n"', '"\\e"', '"\\ud800"', "|", ">-", "? key", ": v", "--- ", "...",
    "%YAML 1.1", "- ", "[" * 80, "{" * 80, "]", "}", "gpu[01-16]", "n[1-99999]", "10.0.0.[1-300]",
    "n[5-1]", "[::1]", "１０.0.0.1", "ｌｏｃａｌｈｏｓｔ", "a\u200bb", "\u2028", "\x85", "\t", "  ", "#",
    "procs: 100000", "gpus: 1025", "port: 0", "connection: local", "address: localhost", "x" * 70_000,
]
NASTY_CHARS = st.sampled_from(list("[]{}:,&*!<>|-#'\"%@`?\n\t \\") + ["\u00a0", "\ufeff", "\uff11", "é"])


def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuzz")
    (folder / "worker").mkdir()
    (folder / "worker" / "train.py").write_text("")
    return folder


@pytest.fixture(scope="module")
def inventory_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_dir(tmp_path_factory) / "cluster.yaml"


def check(text: str, path: Path) -> None:
    """The property: a Cluster, or one InventoryError at a line of the file; fast and small."""
    tracemalloc.start()
    started = time.process_time()   # CPU seconds: the parser's cost, not the machine's load
    try:
        cluster = parse(text, path)
    except InventoryError as error:
        message = str(error)
        assert error.exit_code == 2 and error.hint, message
        assert error.line is not None and 1 <= error.line <= text.count("\n") + 1, message
        assert message.startswith(f"{path}:{error.line}: "), message
        assert len(message.splitlines()) == 2 and "Traceback" not in message, message
    else:
        assert isinstance(cluster, Cluster)
        assert 1 <= len(cluster.hosts) <= MAX_HOSTS and cluster.world_size <= MAX_WORLD_SIZE
        assert cluster.world_size == sum(h.procs for h in cluster.hosts) == len(cluster.ranks)
    finally:
        elapsed = time.process_time() - started
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert elapsed < MAX_SECONDS, f"{elapsed:.2f}s for {text[:200]!r}"
    assert peak < MAX_BYTES, f"{peak >> 20} MB for {text[:200]!r}"


def run_fuzz(strategy: st.SearchStrategy[str], weight: float, path: Path) -> None:
    """Run `check` on `weight` x the profile's max_examples documents (tests/conftest.py:
    400 in `make test`, 100 in `make test-fast`) and prove that they did run."""
    examples = round(weight * settings().max_examples)   # the loaded profile
    seen: list[int] = []

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def fuzz(text: str) -> None:
        seen.append(1)
        check(text, path)

    fuzz()
    assert len(seen) >= examples


# ---- 1. valid inventories with parts replaced by random values ------------------------------

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.text(alphabet=st.characters(codec="ascii"), max_size=30),
    st.sampled_from(["localhost", "gpu[01-16]", "10.0.0.[1-8]", "worker.train", "train.py", "local",
                     "accept-new", "~/x", "../x", "/abs", "-rf", "a@b", "h:22", "ＡＢ", "\u200b"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(list(VALID) + ["address", "gpus", "procs", "<<", "x-a"]),
                              st.text(max_size=8)), inner, max_size=4)), max_leaves=12)


@st.composite
def replaced_documents(draw: Callable) -> str:
    doc = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        parent, key = draw(st.sampled_from(_slots(doc)))
        shared = _values(doc)
        # reuse a value already in the document now and then: yaml.dump writes it once with
        # an anchor and refers to it with aliases (a list holding itself makes a loop)
        # mostly scalars: a list where a value belongs stops the reading at once
        choices = [SCALARS, SCALARS, SCALARS, VALUES] + ([st.sampled_from(shared)] if shared else [])
        parent[key] = draw(st.one_of(choices))
    if isinstance(doc.get("hosts"), list) and draw(st.booleans()):
        doc["hosts"].append(doc["hosts"])  # a list holding itself: a recursive alias
    flow = draw(st.sampled_from([None, True, False]))
    try:
        # libyaml's emitter (the same representer, so the same anchors and aliases): the
        # pure-Python one cost a third of this test's CPU, the documents are the same kind
        return yaml.dump(doc, Dumper=DUMPER, default_flow_style=flow,
                         allow_unicode=draw(st.booleans()), sort_keys=False)
    except (yaml.YAMLError, ValueError, TypeError):  # e.g. a key PyYAML cannot write
        return yaml.safe_dump(VALID)


def _slots(doc: Any) -> list[tuple]:
    """Every (container, key) whose value may be replaced, walking the document."""
    slots: list[tuple] = []
    stack, seen = [doc], {id(doc)}
    while stack and len(slots) < 200:
        node = stack.pop()
        for key in list(node) if isinstance(node, dict) else range(len(node)):
            slots.append((node, key))
            child = node[key]
            if isinstance(child, (dict, list)) and id(child) not in seen:  # values may form loops
                seen.add(id(child))
                stack.append(child)
    return slots


def _values(doc: dict[str, Any]) -> list[Any]:
    return [parent[key] for parent, key in _slots(doc) if isinstance(parent[key], (dict, list))][:20]


def test_fuzz_replaced_values(inventory_path: Path) -> None:
    run_fuzz(replaced_documents(), 1, inventory_path)


# ---- 2. valid inventories mutated as text -------------------------------------------------

@st.composite
def mutated_documents(draw: Callable) -> str:
    lines = draw(st.sampled_from(SEEDS)).splitlines()
    for _ in range(draw(st.integers(1, 5))):
        at = draw(st.integers(0, len(lines)))
        what = draw(st.sampled_from(["value", "insert", "delete", "duplicate", "chars", "indent", "nest"]))
        line = lines[at] if at < len(lines) else ""
        if what == "value" and ":" in line:
            line = line.split(":", 1)[0] + ": " + draw(st.sampled_from(SNIPPETS))
        elif what == "insert":
            indent = " " * draw(st.sampled_from([0, 2, 4]))
            lines.insert(at, indent + draw(st.sampled_from(SNIPPETS + ["- " + s for s in SNIPPETS[:20]])))
            continue
        elif what == "delete" and lines:
            del lines[min(at, len(lines) - 1)]
            continue
        elif what == "duplicate":
            lines.insert(at, line)
            continue
        elif what == "chars":
            cut = draw(st.integers(0, len(line)))
            line = line[:cut] + draw(st.text(NASTY_CHARS, min_size=1, max_size=4)) + line[cut:]
        elif what == "indent":
            line = " " * draw(st.integers(0, 6)) + line.lstrip()
        elif what == "nest":
            depth = draw(st.sampled_from([10, 63, 64, 65, 500]))
            line = "x-deep: " + "[" * depth + "]" * depth
        lines[at:at + 1] = [line]
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\n\n# end\n"]))


def test_fuzz_text_mutations(inventory_path: Path) -> None:
    run_fuzz(mutated_documents(), 2, inventory_path)


# ---- 3. anchors, aliases and merge keys of random shape ----------------------------------

@st.composite
def anchor_documents(draw: Callable) -> str:
    """x-0 .. x-n, each a mapping or list built from the earlier ones (merged or aliased);
    a host and the job then use some of them. Includes billion laughs and self-references."""
    lines = ["name: demo", "x-0: &a0 {gpus: 1}"]
    count = draw(st.integers(1, 25))
    for i in range(1, count + 1):
        refs = draw(st.lists(st.integers(0, i), min_size=1, max_size=12))  # i itself: a loop
        aliases = ", ".join(f"*a{r}" for r in refs)
        shape = draw(st.sampled_from(["merge", "list", "nested", "plain"]))
        body = {"merge": f"{{<<: [{aliases}], k{i}: 1}}", "list": f"[{aliases}]",
                "nested": f"{{v: [{aliases}]}}", "plain": f"{{procs: {i}}}"}[shape]
        if i in refs and shape != "plain":
            lines.append(f"x-{i}: &a{i}\n  <<: *a{i}" if shape == "merge" else f"x-{i}: &a{i} [*a{i}]")
        else:
            lines.append(f"x-{i}: &a{i} {body}")
    use = draw(st.integers(0, count))
    host = draw(st.sampled_from([f"  - <<: *a{use}\n    address: localhost\n    connection: local",
                                 f"  - *a{use}", "  - localhost"]))
    job = draw(st.sampled_from(["", f"  args: *a{use}\n", f"  env: *a{use}\n", f"  <<: *a{use}\n"]))
    return "\n".join(lines) + f"\nhosts:\n{host}\njob:\n  entrypoint: worker.train\n{job}"


def test_fuzz_anchors_and_merge_keys(inventory_path: Path) -> None:
    run_fuzz(anchor_documents(), 0.75, inventory_path)


def test_seeds_are_valid(inventory_path: Path) -> None:
    """The mutations start from inventories that load (else the fuzz only tests errors)."""
    for seed in SEEDS:
        assert isinstance(parse(seed, inventory_path), Cluster)
