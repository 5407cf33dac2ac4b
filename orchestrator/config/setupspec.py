"""`setup:` in cluster.yaml: what runs on every host after the code sync, before launch.

Shapes (the README's "Setup" section):

- a list of strings: shell commands, run one after the other (the first failure stops);
- a mapping `{commands: <one of these shapes>, once_per: filesystem | host}`: where hosts
  share their job folder (NFS homes), setup runs on one of them (`filesystem`, the
  default) or on each (`host`);
- one string: one command, except a single word ending in `.sh`, which is a script in
  the code folder (`scripts/setup.sh`, a path as `job.entrypoint` writes it: relative to
  the code folder, where each code.paths entry keeps its name). With code.paths, the
  script must be among the pushed files.

The fingerprint decides whether setup runs again: its text, the script's content, and
the content of every pushed file whose path appears as a word of a command (or of the
script): `pip install -r requirements.txt` re-runs when requirements.txt changes.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from yaml.nodes import MappingNode, Node, ScalarNode

from orchestrator.config.yamlnodes import TAG, Section, check_text, short

MAX_COMMANDS = 200


ONCE_PER = ("filesystem", "host")
SETUP_KEYS = ("commands", "once_per")


@dataclass(frozen=True)
class SetupSpec:
    commands: tuple[str, ...]  # shell commands; empty when `script` is set
    script: str | None  # a script's path in the code folder
    line: int  # where `setup:` is, for messages
    # hosts that share their job folder (NFS): "filesystem" runs setup on one of them
    # (one pip install into a shared venv, not several at once); "host": on each
    once_per: str = "filesystem"

    @property
    def text(self) -> str:
        return self.script if self.script is not None else "\n".join(self.commands)


def parse_setup(top: Section, code_paths: tuple[str, ...], base_dir: Path) -> SetupSpec | None:
    """`setup:` as a command, a list of commands or a script, or a mapping of those
    (`commands:`) with `once_per: filesystem | host`."""
    node = top.node("setup")
    if node is None or node.tag == TAG + "null":
        return None
    src, line, once_per, what = top.src, top.key_line("setup"), "filesystem", "setup"
    if isinstance(node, MappingNode):
        sec = Section(src, node, "setup", line)
        sec.check_keys(SETUP_KEYS, {})
        once_per = sec.choice("once_per", ONCE_PER, "filesystem")
        node, what = sec.node("commands"), "setup.commands"
        if node is None:
            src.fail(line, "missing `setup.commands`",
                     "add `commands: [pip install -r requirements.txt]` under `setup`")
        sec.refuse_empty("commands", "give a command (`commands: [pip install -r "
                                     "requirements.txt]`), or delete `setup:`")
    spec = _commands(top, node, what, line, code_paths, base_dir)
    return replace(spec, once_per=once_per) if spec is not None else None


def _commands(top: Section, node: Node, what: str, line: int, code_paths: tuple[str, ...],
              base_dir: Path) -> SetupSpec | None:
    src = top.src
    one = isinstance(node, ScalarNode)
    nodes = [node] if one else src.sequence(node, what)
    if len(nodes) > MAX_COMMANDS:
        src.fail(
            node,
            f"`{what}` has {len(nodes)} commands, more than {MAX_COMMANDS}",
            "put them in a script pushed with the code: `setup: scripts/setup.sh`",
        )
    commands = []
    for i, item in enumerate(nodes):
        item_what = what if one else f"{what}[{i}]"
        value = src.value(item, item_what)
        if not isinstance(value, str) or not value.strip():
            src.fail(
                item,
                f"`{item_what}` must be a shell command (text), got {src.describe(item)}",
                "write each command as text, quoted if it has `: ` or starts with a special "
                "character",
            )
        check_text(src, item, item_what, value)
        commands.append(value)
    if not commands:
        return None
    if one and commands[0].endswith(".sh") and len(commands[0].split()) == 1:
        return SetupSpec((), _script(top, node, commands[0], code_paths, base_dir), line)
    return SetupSpec(tuple(commands), None, line)


def _script(top: Section, node: Node, value: str, code_paths: tuple[str, ...],
            base_dir: Path) -> str:
    pure = PurePosixPath(value)
    if value.startswith(("~", "-")) or pure.is_absolute() or ".." in pure.parts:
        top.src.fail(
            node,
            f"`setup` script {short(value)!r} must be a path inside the synced code folder",
            "write it relative to the code folder (e.g. `scripts/setup.sh`), or write a "
            "list of commands: `setup: [bash /abs/path/setup.sh]`",
        )
    pushed = {PurePosixPath(p).name: base_dir / p for p in code_paths}
    if pushed:
        first, *rest = pure.parts
        local = pushed.get(first)
        if local is None or not local.joinpath(*rest).is_file():
            top.src.fail(
                node,
                f"`setup` script {short(value)!r} is not in code.paths",
                "paths are relative to the synced code folder, where each code.paths entry "
                f"keeps its name (pushed: {', '.join(sorted(pushed))}); or add it to code.paths",
            )
    return str(pure)


# ---------------------------------------------------------------- fingerprint


def words(text: str) -> Iterable[str]:
    """The words of shell text that could name a file: split like a shell (plainly on
    whitespace when the quotes do not close), `--opt=path` gives `path` too."""
    for line in text.splitlines():
        try:
            parts = shlex.split(line, comments=True)
        except ValueError:
            parts = line.split()
        for word in parts:
            yield word
            if "=" in word:
                yield word.split("=", 1)[1]


def named_files(texts: Iterable[str], digests: dict[str, str]) -> dict[str, str]:
    """{pushed path: sha256} of the pushed files (paths relative to the code folder)
    that a word of the texts names (`./requirements.txt` names requirements.txt)."""
    found = {}
    for text in texts:
        for word in words(text):
            rel = posixpath.normpath(word) if word else ""
            if rel in digests:
                found[rel] = digests[rel]
    return found


def fingerprint(spec: SetupSpec, digests: dict[str, str], script_text: str = "") -> str:
    """sha256 over the setup's text, the script's content and the named files' digests."""
    named = named_files([spec.text, script_text], digests)
    if spec.script is not None and spec.script in digests:
        named[spec.script] = digests[spec.script]
    doc = {"commands": list(spec.commands), "script": spec.script, "files": sorted(named.items())}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
