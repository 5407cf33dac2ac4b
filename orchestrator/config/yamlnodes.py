"""Read YAML as a tree of nodes that remember their lines: the inventory's parsing layer.

`yaml.safe_load` forgets where every value came from and silently keeps the last of
two duplicate keys. Composing the node tree and walking it ourselves keeps the line of
every key and value, so each mistake in cluster.yaml is reported as `file:LINE: ...`,
and lets us refuse what YAML quietly lets through. Scalars are still turned into
values by PyYAML's SafeConstructor, so `5`, `1.5`, `true`, `null` mean what they mean
in `yaml.safe_load`.

The file may come from anyone, so reading it is bounded: nesting depth, aliases and
the work done by merge keys (`<<`) are capped, and every text value is checked for
control characters and size before it can reach a host (see the limits below).
"""
from __future__ import annotations

import bisect
import datetime
import difflib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, overload

import yaml
from yaml.constructor import SafeConstructor
from yaml.error import Mark
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from orchestrator.errors import InventoryError

TAG = "tag:yaml.org,2002:"
REQUIRED: Any = object()  # default meaning "the key must be given"

Items = dict[str, tuple[Node, Node]]  # key -> (key node, value node)

# Limits: far above any real inventory, low enough that no file can make reading it
# slow or big (an alias costs a few bytes but may stand for a whole subtree).
MAX_DEPTH = 64             # nested lists and mappings
MAX_ALIASES = 10_000       # `*name` uses in the whole file
MAX_NODES = 100_000        # keys, values, lists and mappings: composing costs ~10 us each
MAX_MERGE_DEPTH = 16       # `<<` merging a mapping that itself merges, and so on
MAX_MERGE_WORK = 100_000   # mappings merged plus keys copied by `<<`, in the whole file
MAX_SECONDS = 7 * 86400     # a timeout in the inventory (timers and sockets hold it)
MAX_VALUE_BYTES = 64 << 10  # one text value (an arg, an env value, a path, ...)

# Control characters (tab aside) and lone surrogates: a NUL cuts a value short on the
# host, a line break splits a command or a config line there, escapes garble the
# terminal, and a surrogate (`"\ud800"`) cannot even be encoded to be sent.
_CONTROL_RE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
# libyaml (PyYAML's C extension) when present: ~10 times faster on big files.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NON_PRINTABLE = yaml.reader.Reader.NON_PRINTABLE  # what YAML refuses in a file
_UNSENDABLE_RE = re.compile("[\x00\ud800-\udfff]")   # what no argv or environment can hold
_CONTROL_NAMES = {"\0": "a NUL character", "\n": "a line break", "\r": "a carriage return"}

_KINDS = [
    (bool, "true/false"),  # before int: bool is an int subclass
    (int, "a whole number"),
    (float, "a number"),
    (str, "text"),
    (type(None), "nothing"),
    (datetime.date, "a date"),
    (bytes, "binary data"),
]


_TOO_DEEP = (f"lists and mappings are nested more than {MAX_DEPTH} deep", "an inventory needs 4 levels: flatten it")


class _Limit(Exception):
    """A reading limit was hit at `mark`; Source reports it with the mark's line."""

    def __init__(self, mark: Any, message: str, hint: str) -> None:
        super().__init__(message)
        self.mark, self.message, self.hint = mark, message, hint


def _check_events(text: str) -> None:
    """Walk the parser's events (no tree yet) and refuse a document nested too deep, with
    too many aliases or too many values, before anything composes it: the composer
    recurses once per level (libyaml's crashes the process past a few thousand)."""
    loader = _Loader(text)
    depth = nodes = aliases = 0
    try:
        while True:
            event = loader.get_event()
            if isinstance(event, (yaml.DocumentEndEvent, yaml.StreamEndEvent)) or event is None:
                return
            if isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
                continue
            nodes += isinstance(event, yaml.NodeEvent)
            aliases += isinstance(event, yaml.AliasEvent)
            depth += isinstance(event, yaml.CollectionStartEvent)
            if depth > MAX_DEPTH:
                raise _Limit(event.start_mark, *_TOO_DEEP)
            if aliases > MAX_ALIASES:
                raise _Limit(event.start_mark, f"more than {MAX_ALIASES} aliases (`*name`)",
                             "write the values out, or use fewer anchors")
            if nodes > MAX_NODES:
                raise _Limit(event.start_mark, f"more than {MAX_NODES} keys and values in all",
                             "list many hosts with ranges such as gpu[001-512]")
    finally:
        loader.dispose()


class Source:
    """The file being read: composes it and turns (node or line, message) into InventoryError."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        self._constructor = SafeConstructor()
        self._breaks: list[int] | None = None
        self._last = 1
        self._merge_work = 0
        self.checked: set[int] = set()  # ids of nodes check_text() passed

    def line(self, where: Any) -> int:
        """1-based line of a node or a mark (PyYAML's or libyaml's)."""
        mark = where.start_mark if isinstance(where, Node) else where
        return self.line_at(mark.index)

    def line_at(self, index: int) -> int:
        """1-based line of a character, counting only '\\n' as editors do (YAML also counts
        U+0085, U+2028, U+2029), and never past the last line that holds YAML: an error
        at the end of the file (an unclosed `[`) belongs there, not to a trailing comment."""
        if self._breaks is None:
            self._breaks = [m.start() for m in re.finditer("\n", self.text)]
            self._last = self._last_content()
        return min(bisect.bisect_left(self._breaks, max(index, 0)) + 1, self._last)

    def _last_content(self) -> int:
        lines = self.text.split("\n")
        while len(lines) > 1 and (not lines[-1].strip() or lines[-1].lstrip().startswith("#")):
            lines.pop()
        return len(lines)

    def fail(self, where: Node | Mark | int | None, message: str, hint: str = "") -> NoReturn:
        line = where if isinstance(where, int) or where is None else self.line(where)
        raise InventoryError(self.path, line, message, hint)

    def compose(self) -> Node | None:
        """The root node, or None for a file with nothing but comments."""
        bad = _NON_PRINTABLE.search(self.text)
        if bad:
            self.fail(self.line_at(bad.start()), f"not valid YAML: character {bad.group()!r} is not allowed",
                      "remove the control character")
        try:
            _check_events(self.text)
            loader = _Loader(self.text)
            try:
                root: Node | None = loader.get_single_node()
                return root
            finally:
                loader.dispose()
        except _Limit as exc:
            self.fail(exc.mark, exc.message, exc.hint)
        except yaml.MarkedYAMLError as exc:
            self._yaml_error(exc)
        except yaml.reader.ReaderError as exc:  # the check above should have caught it
            self.fail(self.line_at(exc.position), f"not valid YAML: {exc.reason}", "remove the control character")

    def _yaml_error(self, exc: yaml.MarkedYAMLError) -> NoReturn:
        mark = exc.problem_mark or exc.context_mark
        line = self.line(mark) if mark else 1
        problem = exc.problem or exc.context or "invalid YAML"
        if "maximum nesting depth" in problem:
            # libyaml 0.2.6 (PyYAML 6.0.4's wheels) stops deep nesting in its scanner, before
            # _check_events sees the events: the same limit, said the same way
            self.fail(line, *_TOO_DEEP)
        if "another document" in problem:
            self.fail(line, "not valid YAML: a second document starts here (`---`)",
                      "an inventory is one document: remove the `---` line and what follows it")
        self.fail(line, f"not valid YAML: {problem}",
                  "check the indentation and the quoting on this line (a value that "
                  "contains ': ' or starts with '*', '&', '!', '[' or '{' needs quotes)")

    def value(self, node: Node, what: str) -> Any:
        """A scalar's value as yaml.safe_load would give it."""
        if not isinstance(node, ScalarNode):
            hint = ("YAML reads `text: more` as a mapping: put the whole value in quotes, "
                    "e.g. `\"echo step: 1\"`" if isinstance(node, MappingNode)
                    else "write one value here, not a list")
            self.fail(node, f"`{what}` must be a single value, not {self.describe(node)}", hint)
        try:
            return self._constructor.construct_object(node)
        except yaml.YAMLError:
            self.fail(node, f"`{what}` has the YAML tag {node.tag!r}, which orch does not understand",
                      "remove the tag (`!...`): only plain values are understood")
        except Exception:  # PyYAML's constructors raise ValueError, KeyError, ... for values
            # such as `!!int x`, `!!bool maybe`, a 5,000-digit number or the date 2024-02-30
            kind = node.tag.rsplit(":", 1)[-1]
            self.fail(node, f"`{what}`: {short(node.value)!r} cannot be read as a YAML {kind}",
                      "write a plain value: a short number, or text in quotes")

    def describe(self, node: Node) -> str:
        """What the user wrote, in words: 'a list', "text ('two')"."""
        if isinstance(node, MappingNode):
            return "a mapping (key: value lines)"
        if isinstance(node, SequenceNode):
            return "a list"
        try:
            value = self._constructor.construct_object(node)
        except Exception:  # see value(): a tag PyYAML refuses, or a value it cannot convert
            return f"a value tagged {node.tag}"
        kind = next((name for typ, name in _KINDS if isinstance(value, typ)), type(value).__name__)
        return kind if value is None else f"{kind} ({short(node.value)!r})"

    def mapping(self, node: Node, what: str) -> Items:
        """The keys of a mapping node, in order; null means empty (a section all commented out)."""
        return self._mapping(node, what, ())

    def _mapping(self, node: Node, what: str, merging: tuple[tuple[Node, Node], ...]) -> Items:
        if _is_null(node):
            return {}
        if not isinstance(node, MappingNode) or node.tag != TAG + "map":
            self.fail(node, f"`{what}` must be a mapping of `key: value` lines, got {self.describe(node)}",
                      f"indent the settings of `{what}` under it as `key: value` lines")
        items: Items = {}
        merges: list[tuple[Node, Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag == TAG + "merge":
                merges.append((key_node, value_node))
                continue
            key = self._key(key_node, what)
            if key in items:
                first = self.line(items[key][0])
                self.fail(key_node, f"duplicate key `{_join(what, key)}` (first given on line {first})",
                          "keep only one of them: YAML would silently use the last one")
            items[key] = (key_node, value_node)
        for key_node, merged in merges:
            self._merge_into(items, merged, what, merging + ((node, key_node),))
        return items

    def _merge_into(self, items: Items, node: Node, what: str, merging: tuple[tuple[Node, Node], ...]) -> None:
        # YAML merge keys (`<<: *defaults`): keys given explicitly win, earlier sources win.
        # `merging` holds (mapping, its `<<` key) for each mapping being merged into, from
        # the outermost: to refuse a mapping merging itself, and to name the `<<` written
        # where the settings are used when a limit is hit deeper down.
        outer_key, key_node = merging[0][1], merging[-1][1]
        sources = node.value if isinstance(node, SequenceNode) else [node]
        for source in sources:
            if not isinstance(source, MappingNode):
                self.fail(source, f"`{what}`: `<<` must merge a mapping, got {self.describe(source)}",
                          "write `<<: *anchor` where `&anchor` names a mapping")
            if any(source is mapping for mapping, _ in merging):
                self.fail(key_node, f"`{what}`: `<<` merges a mapping into itself (a recursive merge key)",
                          "merge only other mappings: an anchor cannot be merged inside itself")
            if len(merging) >= MAX_MERGE_DEPTH:
                self.fail(outer_key, f"`{what}`: merge keys (`<<`) are nested more than "
                                     f"{MAX_MERGE_DEPTH} deep", "merge fewer levels of anchors")
            merged = self._mapping(source, what, merging)
            self._spend_merge_work(outer_key, 1 + len(merged))
            for key, pair in merged.items():
                items.setdefault(key, pair)

    def _spend_merge_work(self, key_node: Node, amount: int) -> None:
        """Merges of merges can copy keys exponentially often: the whole file gets a budget."""
        self._merge_work += amount
        if self._merge_work > MAX_MERGE_WORK:
            self.fail(key_node, f"merge keys (`<<`) copy more than {MAX_MERGE_WORK} keys in all "
                                "(anchors that merge anchors, many times over)",
                      "merge each anchor fewer times, or write the settings out")

    def _key(self, node: Node, what: str) -> str:
        if not isinstance(node, ScalarNode) or _is_null(node):
            where = "at the top level" if what == "the top level" else f"in `{what}`"
            self.fail(node, f"a key {where} is {self.describe(node)}",
                      "keys are plain names such as `address` or `gpus`")
        key: str = node.value  # as written: `ON:` is a name here, not YAML 1.1's true
        return key

    def sequence(self, node: Node, what: str) -> list[Node]:
        """The items of a list node; null means empty."""
        if _is_null(node):
            return []
        if not isinstance(node, SequenceNode) or node.tag != TAG + "seq":
            self.fail(node, f"`{what}` must be a list, got {self.describe(node)}",
                      f"write `{what.rsplit('.', 1)[-1]}: [a, b]` or one `- item` per line")
        return list(node.value)


class Section:
    """One mapping (the top level, ssh, a host, code, data, job) read key by key."""

    def __init__(self, src: Source, node: Node | None, name: str, line: int) -> None:
        self.src = src
        self.name = name  # "" for the top level, else e.g. "ssh" or "hosts[2]"
        self.line = line  # where a missing key is reported
        self.items = src.mapping(node, name or "the top level") if node is not None else {}

    def what(self, key: str) -> str:
        return _join(self.name, key)

    def node(self, key: str) -> Node | None:
        pair = self.items.get(key)
        return pair[1] if pair else None

    def key_line(self, key: str) -> int:
        pair = self.items.get(key)
        return self.src.line(pair[0]) if pair else self.line

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

    def refuse_empty(self, key: str, fix: str) -> None:
        """`key:` with nothing after it, refused at its line: for a key whose default is
        not "unset", an empty value would silently mean something else (docs/reference/
        cluster-yaml.md: only user, port, identity_file, the data paths and master_port
        may be left empty)."""
        node = self.node(key)
        if node is not None and _is_null(node):
            self.src.fail(self.key_line(key), f"`{self.what(key)}` has no value", fix)

    def _given(self, key: str, default: Any) -> Node | None:
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

    # The default decides the result's type: REQUIRED or a string gives a string, None
    # (the key may be left out) gives str | None.
    @overload
    def text(self, key: str) -> str: ...
    @overload
    def text(self, key: str, default: str) -> str: ...
    @overload
    def text(self, key: str, default: None) -> str | None: ...

    def text(self, key: str, default: str | None = REQUIRED) -> str | None:
        """A non-empty string (quoted or not); numbers and true/false are refused."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        if not isinstance(value, str):
            self.src.fail(node, f"`{self.what(key)}` must be text, got {self.src.describe(node)}",
                          f'put the value in quotes: {key}: "{short(node.value)}"')
        if not value.strip():
            self.src.fail(node, f"`{self.what(key)}` is empty", f"give `{key}` a value")
        check_text(self.src, node, self.what(key), value)
        text: str = value
        return text

    @overload
    def integer(self, key: str, default: int, low: int, high: int | None = None,
                example: int = 1) -> int: ...
    @overload
    def integer(self, key: str, default: None, low: int, high: int | None = None,
                example: int = 1) -> int | None: ...

    def integer(self, key: str, default: int | None, low: int, high: int | None = None,
                example: int = 1) -> int | None:
        """A whole number in [low, high]; true/false (YAML's yes/no) is not a number."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        wanted = f"a whole number from {low} to {high}" if high is not None else f"a whole number >= {low}"
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or value < low or (high is not None and value > high):
            got = self.src.describe(node) if not ok else short(str(value))
            self.src.fail(node, f"`{self.what(key)}` must be {wanted}, got {got}",
                          f"write e.g. `{key}: {example}`")
        number: int = value
        return number

    @overload
    def number(self, key: str, default: float) -> float: ...
    @overload
    def number(self, key: str, default: None) -> float | None: ...

    def number(self, key: str, default: float | None) -> float | None:
        """A number of seconds above zero and at most MAX_SECONDS (a week): every timer
        and socket timeout it becomes can hold it (1e300 would overflow them)."""
        node = self._given(key, default)
        if node is None:
            return default
        value = self.src.value(node, self.what(key))
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not 0 < value <= MAX_SECONDS:
            got = self.src.describe(node) if not ok else short(str(value))
            self.src.fail(node, f"`{self.what(key)}` must be a number of seconds above 0 and at "
                                f"most {MAX_SECONDS} (a week), got {got}", f"write e.g. `{key}: 10`")
        return float(value)

    def choice(self, key: str, options: Sequence[str], default: str) -> str:
        value = self.text(key, default)
        if value not in options:
            close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
            valid = " or ".join(options)
            hint = f"did you mean `{close[0]}`? (valid: {valid})" if close else f"use {valid}"
            self.src.fail(self.node(key), f"`{self.what(key)}` is {short(str(value))!r}, must be {valid}", hint)
        return value


def scalar_text(src: Source, node: Node, what: str, hint: str, verbatim: bool = False) -> str:
    """A scalar exactly as written (`5`, `1e-5`, `yes` stay as typed); null and nested
    values refused. `verbatim`: a value that reaches the program byte for byte (an arg,
    an env value: a PEM key, a multi-line prompt), so only what no argv or environment
    can hold is refused (NUL, a lone surrogate)."""
    if not isinstance(node, ScalarNode):
        src.fail(node, f"`{what}` must be a single value, not {src.describe(node)}", hint)
    if _is_null(node):
        src.fail(node, f"`{what}` has no value", hint)
    src.value(node, what)  # refuses unknown tags
    check_text(src, node, what, node.value, verbatim)
    text: str = node.value
    return text


def check_text(src: Source, node: Node, what: str, value: str, verbatim: bool = False) -> None:
    """Refuse what would break or garble a value on its way to a host: control
    characters (NUL, line breaks, escapes; a tab is fine) and values over MAX_VALUE_BYTES.
    `verbatim` values may hold any character but NUL and lone surrogates."""
    if id(node) in src.checked:
        return  # an alias used on 4,000 hosts is checked once
    src.checked.add(id(node))
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_VALUE_BYTES:
        src.fail(node, f"`{what}` is {size} bytes long; at most {MAX_VALUE_BYTES} bytes",
                 "shorten it (put long contents in a file that the job reads)")
    if verbatim:
        bad = _UNSENDABLE_RE.search(value)
        if bad:
            src.fail(node, f"`{what}` contains {_CONTROL_NAMES.get(bad.group(), 'a lone surrogate')}"
                           f" ({short(value)!r}), which no program argument or environment "
                           "value can hold (the system ends the text there)",
                     "remove it; pass binary data in a file that the job reads")
        return
    bad = _CONTROL_RE.search(value)
    if bad:
        char = bad.group()
        name = _CONTROL_NAMES.get(char, f"the control character U+{ord(char):04X}")
        src.fail(node, f"`{what}` contains {name} ({short(value)!r})",
                 "write the value on one line, without control characters "
                 "(a YAML `\\0`, `\\n` or `|` block makes them)")


def text_items(sec: Section, key: str) -> list[tuple[str, Node]] | None:
    """A list of non-empty strings (one string is a list of one), or None when absent."""
    node = sec.node(key)
    if node is None:
        return None
    one = isinstance(node, ScalarNode) and node.tag == TAG + "str"
    nodes = [node] if one else sec.src.sequence(node, sec.what(key))
    items = []
    for i, item in enumerate(nodes):
        what = f"{sec.what(key)}[{i}]"
        value = sec.src.value(item, what)
        if not isinstance(value, str) or not value.strip():
            sec.src.fail(item, f"`{what}` must be non-empty text, got {sec.src.describe(item)}",
                         f'put it in quotes: "{short(item.value)}"' if item.value else "remove the empty entry")
        check_text(sec.src, item, what, value)
        items.append((value, item))
    return items


def exists(src: Source, node: Node | None, path: Path, file: bool = False) -> bool:
    """path.exists() (or is_file()) for a path the inventory names, with what the OS
    refuses (a name too long, ...) as the inventory's error rather than a traceback."""
    try:
        return path.is_file() if file else path.exists()
    except OSError as exc:
        src.fail(node, f"{short(str(path))!r} cannot be looked up: {exc.strerror}",
                 "shorten the path (relative to the folder of cluster.yaml)")


def short(text: str, limit: int = 60) -> str:
    """`text` cut for a message: an error line stays one readable line."""
    return text if len(text) <= limit else text[:limit] + "..."


def _is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == TAG + "null"


def _join(section: str, key: str) -> str:
    key = short(key, 40) if key.isprintable() else repr(short(key, 40))  # any text: keep messages one line
    return f"{section}.{key}" if section and section != "the top level" else key
