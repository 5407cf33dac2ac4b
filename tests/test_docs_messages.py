"""What the docs say orch prints, checked against what it can print, and the key reference
against the keys the inventory accepts (docs/reference/cluster-yaml.md vs orchestrator/config/).

Every message of docs/troubleshooting.md (a heading in backticks, or the first cell of a
table row) is cut at its placeholders (`h`, `x`, `N`, numbers, paths, quoted names, `...`,
`<...>`, values in backticks); each remaining piece of two words or more must be text of
one string literal in orchestrator/ or worker/ (an f-string's literal parts). A heading
whose message orch no longer prints, or prints in other words, fails here."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from orchestrator.config import arrayspec, hostspec, inventory, jobspec, setupspec

REPO = Path(__file__).resolve().parent.parent
TROUBLE = REPO / "docs" / "troubleshooting.md"
KEYS_PAGE = REPO / "docs" / "reference" / "cluster-yaml.md"

# what is a value in a documented message, not orch's words
PLACEHOLDER = re.compile(r"""
    \.\.\.                                  # left out
  | <[^>]*>                                 # <path>, <job dir>
  | `[^`]*`                                 # a value in backticks: `python3`
  | (?<!\w)'[^']*'(?!\w)                    # a quoted name: 'x' (not rank 2's)
  | \b(?:receive(?=\ failed)|class\ folder|code(?=\ \d)|via\ bastion|it$)   # words orch fills in
  | \(\.\.\.\)
  | SHA256:\S*
  | \S*[/~]\S*                              # a path: /usr/bin/python3, data/shards
  | \S+\.(?:yaml|json|py|log|txt|gitignore|pt)\S*
  | \[[^\]]*\]\S*                           # [h]:22, h[1-2]
  | \b\d[\d.:]*\b                           # 29500, 2.5.1, 10.0.0.8:41234
  | \b(?:h|h0|h1|h2|x|X|Y|C|N|T|T0|u|b|R|I|eth0|eth7|lo|gpu9|gpu03|stauts|status)\b
""", re.X)
# words of the system or of libraries, quoted in a message as they come
FOREIGN = ("Name or service not known", "Network is unreachable", "Connect failed",
           "Unparsable line Port", "Permission denied", "Read-only file system",
           "No module named", "unrecognized arguments", "invalid choice",
           "no space left on device")


def messages() -> list[tuple[int, str]]:
    """(line, message) for each documented message."""
    out = []
    for n, line in enumerate(TROUBLE.read_text(encoding="utf-8").splitlines(), 1):
        heading = re.match(r"### (?:Not an error: )?(`+) ?(.*?) ?\1(?:$|[ ,:])", line)
        row = re.match(r"\| (`+) ?(.*?) ?\1", line)
        found = heading or row
        if found and not found.group(2).startswith("orch "):   # a command, not a message
            out.append((n, found.group(2)))
    return out


def pieces(message: str) -> list[str]:
    """The message's own words: the pieces between its placeholders, of two words or more."""
    text = message
    for foreign in FOREIGN:
        text = text.replace(foreign, "\x00")
    parts = re.split(PLACEHOLDER, text)
    out = []
    for part in parts:
        for bit in part.split("\x00"):
            bit = bit.strip(" ,:;.()")
            if len(bit.split()) >= 2 and len(bit) >= 8:
                out.append(bit)
    return out


MARKUP = re.compile(r"\[/?(?:bold|dim|red|green|yellow|cyan|italic| )*\]")


@cache
def templates() -> list[tuple[tuple[str, ...], re.Pattern[str]]]:
    """Every string literal of orchestrator/ and worker/ as a pattern: its literal text,
    and each `{...}` of an f-string as any text. With its longest literal part, to try
    only the patterns that can match."""
    out: list[tuple[tuple[str, ...], re.Pattern[str]]] = []
    for folder in ("orchestrator", "worker"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
            for node in ast.walk(tree):
                if id(node) in docstrings:
                    continue
                if isinstance(node, ast.JoinedStr):
                    parts = [MARKUP.sub("", str(v.value)) if isinstance(v, ast.Constant) else None
                             for v in node.values]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    parts = [MARKUP.sub("", node.value)]
                else:
                    continue
                # a %-format's fields are values too (the agent's messages)
                parts = [q for t in parts for q in
                         ([None] if t is None else _split_percent(t))]
                texts = [t for t in parts if isinstance(t, str) and t]
                if sum(map(len, texts)) < 10:
                    continue
                if len(parts) > 1 and parts[0] in (None, "") and parts[1] is None:
                    parts = parts[1:]
                if parts[0] is None and isinstance(parts[1], str) and parts[1].startswith(": "):
                    parts = [parts[1][2:], *parts[2:]]   # `{host}: ...`: the docs leave out the host
                while parts and (parts[0] is None or not parts[0].strip(" ,:;")):
                    parts = parts[1:]   # a leading field, or only punctuation before one
                head = parts[0] if parts else None
                if head is None:
                    continue
                parts[0] = head = head.lstrip()
                anchor = "".join(re.findall(r"\s*\S+", head)[:2])
                if len(anchor) >= 4:
                    out.append(((anchor,), re.compile(pattern(parts), re.S)))
    return out


def pattern(parts: list[str | None]) -> str:
    """A regex for the literal's text (a field is any text) that may stop after any word:
    the docs cut a long message short, or end it with `(...)`."""
    if not parts:
        return ""
    head, rest = parts[0], parts[1:]
    if head is None:
        return f"(?:.+?{pattern(rest)})?" if rest else ""   # a last field covers nothing
    words = re.findall(r"\s*(?:\w[\w'-]*|[^\w\s])", head)[:MAX_WORDS] or [head]
    tail = head[sum(map(len, words)):]
    inner = re.escape(tail) + pattern(rest) if tail or rest else ""
    for word in reversed(words[1:]):
        inner = f"{re.escape(word)}(?:{inner})?" if inner else re.escape(word)
    return re.escape(words[0]) + (f"(?:{inner})?" if inner else "")


MAX_WORDS = 40


def _split_percent(text: str) -> list[str | None]:
    bits = re.split(r"%(?:\(\w+\))?[-#0 +]?\d*(?:\.\d+)?[sdrfgx]", text)
    out: list[str | None] = []
    for i, bit in enumerate(bits):
        out += [None, bit] if i else [bit]
    return out


def covered(message: str) -> set[int]:
    """The characters of `message` that some string of orch's can have printed."""
    chars: set[int] = set()
    for literal, regex in templates():
        if literal and all(t in message for t in literal):
            for m in regex.finditer(message):
                chars.update(range(m.start(), m.end()))
    return chars


def unprinted(message: str) -> list[str]:
    """The message's own pieces that no string of orch's covers."""
    chars = covered(message)
    out = []
    for piece in pieces(message):
        at = message.find(piece)
        if at < 0 or not set(range(at, at + len(piece))) <= chars:
            out.append(piece)
    return out


def test_every_troubleshooting_message_is_one_orch_can_print() -> None:
    found = messages()
    assert len(found) > 100, "the page's messages were not found: the test reads it wrong"
    missing = [f"docs/troubleshooting.md:{n}: {piece!r} (of `{msg}`)"
               for n, msg in found for piece in unprinted(msg)]
    assert not missing, "messages orch does not print (in these words):\n" + "\n".join(missing)


def test_pieces_leave_out_the_values() -> None:
    assert pieces("h: 2 GPUs asked for, 1 found (nvidia-smi)") == ["GPUs asked for", "found (nvidia-smi"]
    assert pieces("remote_dir not writable: <path>: Permission denied") == ["remote_dir not writable"]


# ---------------------------------------------------------------- the key reference

def accepted_keys() -> set[str]:
    """Every key the inventory reads, as the reference names it."""
    keys = {k for k in inventory.TOP_KEYS}
    keys |= {f"ssh.{k}" for k in hostspec.SSH_KEYS}
    keys |= {f"hosts[].{k}" for k in hostspec.HOST_KEYS if k not in hostspec.SSH_KEYS}
    keys |= {f"code.{k}" for k in inventory.CODE_KEYS}
    keys |= {f"data.{k}" for k in inventory.DATA_KEYS}
    keys |= {f"job.{k}" for k in jobspec.JOB_KEYS}
    keys |= {f"job.array.{k}" for k in arrayspec.ARRAY_KEYS}
    keys |= {f"setup.{k}" for k in setupspec.SETUP_KEYS}
    for name in ("NETWORK_KEYS", "HOST_NETWORK_KEYS"):   # network: (config/networkspec.py)
        try:
            from orchestrator.config import networkspec
        except ImportError:
            break
        prefix = "network." if name == "NETWORK_KEYS" else "hosts[].network."
        keys |= {prefix + k for k in getattr(networkspec, name, ())}
    return keys


def documented_keys() -> set[str]:
    """The keys the reference's table (and its notes) name: `job.restarts` / `job.min_hosts`,
    `hosts[].gpus` / `procs` (the second of a pair keeps the first's section)."""
    text = KEYS_PAGE.read_text(encoding="utf-8")
    keys: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*`) \|", text, flags=re.M):
        names = re.findall(r"`([^`]+)`", row)
        section = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
        for name in names:
            keys.add(name if "." in name or not section else f"{section}.{name}")
    keys |= set(re.findall(r"`((?:ssh|job|code|data|setup|network|hosts\[\])\.[a-z_.\[\]]+)`", text))
    required = re.search(r"^Required: (.*?)\n\n", text, flags=re.M | re.S)
    keys |= set(re.findall(r"`(\w+)`", required.group(1) if required else ""))
    return keys


def test_the_key_reference_names_every_key_the_inventory_accepts() -> None:
    documented = documented_keys()
    missing = sorted(k for k in accepted_keys() if k not in documented   # a section: its keys
                     and not any(d.startswith(k + ".") for d in documented))
    assert not missing, f"keys orchestrator/config/ accepts that {KEYS_PAGE.name} does not name: {missing}"


def test_the_key_reference_names_no_key_the_inventory_refuses() -> None:
    accepted = accepted_keys()
    sections = {k.split(".")[0] for k in accepted}
    unknown = sorted(k for k in documented_keys() if k.split(".")[0] in sections | {"hosts[]"}
                     and k not in accepted and "." in k)
    assert not unknown, f"{KEYS_PAGE.name} names keys the inventory refuses: {unknown}"


def test_the_readme_shows_the_reference_cluster_yaml() -> None:
    """README.md's cluster.yaml is the key reference's complete example, line for line."""
    def first_yaml(path: Path) -> str:
        found = re.search(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
        assert found, path
        return found.group(1)
    assert first_yaml(REPO / "README.md") == first_yaml(KEYS_PAGE), \
        "README.md's cluster.yaml has drifted from docs/reference/cluster-yaml.md's: copy it over"
