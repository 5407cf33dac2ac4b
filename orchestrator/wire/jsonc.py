"""JSON for the agent and the wire, on the interpreter's own C codec (`_json`).

`json`'s import loads `re` (its decoder and encoder compile patterns) and with it `enum`:
about 1.2 MiB and 8-10 ms in every agent and every job's supervisor, on every host, for a
codec the C accelerator already is. `dumps` and `loads` here give what `json.dumps` and
`json.loads` give with their default arguments (the wire's bytes are the same), through
the same C functions `json` itself calls. Where `_json` is missing or its private
signature ever differs, `json` is imported and used instead, so the result never changes,
only its cost. A document `_json` refuses raises `ValueError`, as `json.loads` does (the C
scanner builds its `JSONDecodeError` from `json.decoder`, imported then).
"""
from __future__ import annotations

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable

_WHITESPACE = " \t\n\r"   # json.decoder.WHITESPACE
_CONSTANTS = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}


class _Context:
    """The attributes `_json.make_scanner` reads: json.JSONDecoder()'s defaults."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__


def _not_serializable(o: Any) -> Any:
    raise TypeError("Object of type %s is not JSON serializable" % type(o).__name__)


def _c_codec() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """(scanner, make_encoder, encoder of a string) of `_json`, or None where they do not
    give what `json` gives for a sample."""
    try:
        import _json
        scanner = _json.make_scanner(_Context())  # type: ignore[arg-type]
        codec = (scanner, _json.make_encoder, _json.encode_basestring_ascii)
        if scanner('{"a": [1, 2.5, "\\u00e9"]}', 0) != ({"a": [1, 2.5, "\u00e9"]}, 25) \
                or _encode(codec, {"a": [1, None]}, (", ", ": ")) != '{"a": [1, null]}':
            return None
        return codec
    except (ImportError, AttributeError, TypeError, ValueError, StopIteration):
        return None


def _encode(codec: tuple[Callable[..., Any], ...], obj: Any, separators: tuple[str, str]) -> str:
    """What json.JSONEncoder.encode does with the C encoder: a new one per document, for
    its own circular-reference markers (threads encode at once)."""
    item, key = separators
    encoder = codec[1]({}, _not_serializable, codec[2], None, key, item, False, False, True)
    return "".join(encoder(obj, 0))


_C = _c_codec()


def dumps(obj: Any, separators: tuple[str, str] = (", ", ": ")) -> str:
    """json.dumps(obj, separators=separators): ensure_ascii, NaN allowed, keys in their
    order, a circular reference refused (ValueError)."""
    if _C is None:
        return str(_json_module().dumps(obj, separators=separators))
    if isinstance(obj, str):
        return str(_C[2](obj))
    return _encode(_C, obj, separators)


def loads(text: str | bytes | bytearray) -> Any:
    """json.loads(text): one value, whitespace around it allowed; ValueError otherwise.
    Bytes are UTF-8 (a BOM allowed), as json reads them; UTF-16 and -32, which json also
    detects, go to json itself."""
    if _C is not None and not isinstance(text, str) and _utf8(text):
        text = bytes(text).decode("utf-8-sig", "surrogatepass")
    if _C is None or not isinstance(text, str):
        return _json_module().loads(text)
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        obj, end = _C[0](text, start)
    except StopIteration as e:
        raise ValueError("Expecting value: char %d" % e.value) from None
    if end != len(text.rstrip(_WHITESPACE)):
        raise ValueError("Extra data: char %d" % end)
    return obj


def _utf8(data: bytes | bytearray) -> bool:
    """Not what json.detect_encoding reads as UTF-16 or -32: a NUL among the first four
    bytes, or a UTF-16/32 BOM."""
    return 0 not in data[:4] and not data.startswith((b"\xff\xfe", b"\xfe\xff"))


def _json_module() -> Any:
    import json
    return json
