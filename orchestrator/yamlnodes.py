"""Read YAML as a tree of nodes that remember their lines: the inventory's parsing layer.

`yaml.safe_load` forgets where every value came from and silently keeps the last of
two duplicate keys. Composing the node tree and walking it ourselves keeps the line of
every key and value, so each mistake in cluster.yaml is reported as `file:LINE: ...`,
and lets us refuse what YAML quietly lets through. Scalars are still turned into
values by PyYAML's SafeConstructor, so `5`, `1.5`, `true`, `null` mean what they mean
in `yaml.safe_load`.
"""
from __future__ import annotations

import datetime
import difflib
from typing import Any, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple, Union

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .errors import InventoryError

TAG = "tag:yaml.org,2002:"
REQUIRED: Any = object()  # default meaning "the key must be given"

Items = Dict[str, Tuple[Node, Node]]  # key -> (key node, value node)

_KINDS = [
    (bool, "true/false"),  # before int: bool is an int subclass
    (int, "a whole number"),
    (float, "a number"),
    (str, "text"),
    (type(None), "nothing"),
    (datetime.date, "a date"),
    (bytes, "binary data"),
]


class Source:
    """The file being read: composes it and turns (node or line, message) into InventoryError."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self._constructor = SafeConstructor()

    def fail(self, where: Union[Node, int, None], message: str, hint: str = "") -> NoReturn:
        line = where.start_mark.line + 1 if isinstance(where, Node) else where
        raise InventoryError(self.path, line, message, hint)

    def compose(self) -> Optional[Node]:
        """The root node, or None for a file with nothing but comments."""
        try:
            return yaml.compose(self.text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark else 1
            problem = exc.problem or exc.context or "invalid YAML"
            if "another document" in problem:
                self.fail(line, "not valid YAML: a second document starts here (`---`)",
                          "an inventory is one document: remove the `---` line and what follows it")
            self.fail(line, f"not valid YAML: {problem}",
                      "check the indentation and the quoting on this line (a value that "
                      "contains ': ' or starts with '*', '&', '!', '[' or '{' needs quotes)")
        except yaml.reader.ReaderError as exc:
            line = self.text.count("\n", 0, max(exc.position, 0)) + 1
            char = chr(exc.character) if isinstance(exc.character, int) else exc.character
            self.fail(line, f"not valid YAML: character {char!r} is not allowed",
                      "remove the control character")

    def value(self, node: Node, what: str) -> Any:
        """A scalar's value as yaml.safe_load would give it."""
        if not isinstance(node, ScalarNode):
            self.fail(node, f"`{what}` must be a single value, not {self.describe(node)}")
        try:
            return self._constructor.construct_object(node)
        except yaml.YAMLError:
            self.fail(node, f"`{what}` has the YAML tag {node.tag!r}, which orch does not understand",
                      "remove the tag (`!...`): only plain values are understood")

    def describe(self, node: Node) -> str:
        """What the user wrote, in words: 'a list', "text ('two')"."""
        if isinstance(node, MappingNode):
            return "a mapping (key: value lines)"
        if isinstance(node, SequenceNode):
            return "a list"
        try:
            value = self._constructor.construct_object(node)
        except yaml.YAMLError:
            return f"a value tagged {node.tag}"
        kind = next((name for typ, name in _KINDS if isinstance(value, typ)), type(value).__name__)
        return kind if value is None else f"{kind} ({node.value!r})"

    def mapping(self, node: Node, what: str) -> Items:
        """The keys of a mapping node, in order; null means empty (a section all commented out)."""
        if _is_null(node):
            return {}
        if not isinstance(node, MappingNode) or node.tag != TAG + "map":
            self.fail(node, f"`{what}` must be a mapping of `key: value` lines, got {self.describe(node)}",
                      f"indent the settings of `{what}` under it as `key: value` lines")
        items: Items = {}
        merges: List[Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == TAG + "merge":
                merges.append(value_node)
                continue
            key = self._key(key_node, what)
            if key in items:
                first = items[key][0].start_mark.line + 1
                self.fail(key_node, f"duplicate key `{_join(what, key)}` (first given on line {first})",
                          "keep only one of them: YAML would silently use the last one")
            items[key] = (key_node, value_node)
        for merged in merges:
            self._merge_into(items, merged, what)
        return items

    def _merge_into(self, items: Items, node: Node, what: str) -> None:
        # YAML merge keys (`<<: *defaults`): keys given explicitly win, earlier sources win.
        sources = node.value if isinstance(node, SequenceNode) else [node]
        for source in sources:
            if not isinstance(source, MappingNode):
                self.fail(source, f"`{what}`: `<<` must merge a mapping, got {self.describe(source)}",
                          "write `<<: *anchor` where `&anchor` names a mapping")
            for key, pair in self.mapping(source, what).items():
                items.setdefault(key, pair)

    def _key(self, node: Node, what: str) -> str:
        if not isinstance(node, ScalarNode) or _is_null(node):
            where = "at the top level" if what == "the top level" else f"in `{what}`"
            self.fail(node, f"a key {where} is {self.describe(node)}",
                      "keys are plain names such as `address` or `gpus`")
        return node.value  # as written: `ON:` is a name here, not YAML 1.1's true

    def sequence(self, node: Node, what: str) -> List[Node]:
        """The items of a list node; null means empty."""
        if _is_null(node):
            return []
        if not isinstance(node, SequenceNode) or node.tag != TAG + "seq":
            self.fail(node, f"`{what}` must be a list, got {self.describe(node)}",
                      f"write `{what.rsplit('.', 1)[-1]}: [a, b]` or one `- item` per line")
        return list(node.value)


class Section:
    """One mapping (the top level, ssh, a host, code, data, job) read key by key."""

    def __init__(self, src: Source, node: Optional[Node], name: str, line: int) -> None:
        self.src = src
        self.name = name  # "" for the top level, else e.g. "ssh" or "hosts[2]"
        self.line = line  # where a missing key is reported
        self.items = src.mapping(node, name or "the top level") if node is not None else {}

    def what(self, key: str) -> str:
        return _join(self.name, key)

    def node(self, key: str) -> Optional[Node]:
        pair = self.items.get(key)
        return pair[1] if pair else None

    def key_line(self, key: str) -> int:
        pair = self.items.get(key)
        return pair[0].start_mark.line + 1 if pair else self.line

    def check_keys(self, allowed: Sequence[str], elsewhere: Mapping[str, str]) -> None:
        """Refuse unknown keys, with a 'did you mean' or where the key belongs instead."""
        for key, (key_node, _) in self.items.items():
            if key in allowed or (not self.name and key.startswith("x-")):
                continue  # top-level x-* keys hold YAML anchors, as in docker-compose files
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            if close:
                hint = f"did you mean `{close[0]}`?"
            elif key in elsewhere:
                hint = f"`{key}` belongs {elsewhere[key]}"
            else:
                hint = "valid keys here: " + ", ".join(allowed)
            self.src.fail(key_node, f"unknown key `{self.what(key)}`", hint)

    def _given(self, key: str, default: Any) -> Optional[Node]:
        """The value node, or None when the default applies; refuses a missing required key."""
        node = self.node(key)
        if node is None and default is REQUIRED:
            where = f"under `{self.name}`" if self.name else "at the top level"
            self.src.fail(self.line, f"missing `{self.what(key)}`", f"add `{key}: ...` {where}")
        if node is not None and _is_null(node):
            if default is None:
                return None
            hint = ("give it a value" if default is REQUIRED
                    else f"give it a value, or delete the line to use the default ({default})")
            self.src.fail(node, f"`{self.what(key)}` has no value", hint)
        return node

    def text(self, key: str, default: Any = REQUIRED) -> Optional[str]:
        """A non-empty string (quoted or not); numbers and true/false are refused."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        if not isinstance(value, str):
            self.src.fail(node, f"`{self.what(key)}` must be text, got {self.src.describe(node)}",
                          f'put the value in quotes: {key}: "{node.value}"')
        if not value.strip():
            self.src.fail(node, f"`{self.what(key)}` is empty", f"give `{key}` a value")
        return value

    def integer(self, key: str, default: Any, low: int, high: Optional[int] = None,
                example: int = 1) -> Optional[int]:
        """A whole number in [low, high]; true/false (YAML's yes/no) is not a number."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        wanted = f"a whole number from {low} to {high}" if high is not None else f"a whole number >= {low}"
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or value < low or (high is not None and value > high):
            got = self.src.describe(node) if not ok else str(value)
            self.src.fail(node, f"`{self.what(key)}` must be {wanted}, got {got}",
                          f"write e.g. `{key}: {example}`")
        return value

    def number(self, key: str, default: Any) -> Optional[float]:
        """A number above zero (seconds)."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not value > 0 or value == float("inf"):
            got = self.src.describe(node) if not ok else str(value)
            self.src.fail(node, f"`{self.what(key)}` must be a number of seconds above 0, got {got}",
                          f"write e.g. `{key}: 10`")
        return float(value)

    def choice(self, key: str, options: Sequence[str], default: str) -> str:
        value = self.text(key, default)
        if value not in options:
            close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
            valid = " or ".join(options)
            hint = f"did you mean `{close[0]}`? (valid: {valid})" if close else f"use {valid}"
            self.src.fail(self.node(key), f"`{self.what(key)}` is {value!r}, must be {valid}", hint)
        return value


def scalar_text(src: Source, node: Node, what: str, hint: str) -> str:
    """A scalar exactly as written (`5`, `1e-5`, `yes` stay as typed); null and nested values refused."""
    if not isinstance(node, ScalarNode):
        src.fail(node, f"`{what}` must be a single value, not {src.describe(node)}", hint)
    if _is_null(node):
        src.fail(node, f"`{what}` has no value", hint)
    src.value(node, what)  # refuses unknown tags
    return node.value


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == TAG + "null"


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section and section != "the top level" else key
