"""libc's functions for the agent through _ctypes, the C module ctypes is built on.

ctypes' own package (struct, its many types, its loader) is about 5 ms of CPU at each
import, on every host: the supervisor needs one call of libc (prctl, to be a child
subreaper) and a follow two (inotify), and a thousand hosts pay it at once when a job
starts. These are the names ctypes itself uses to call a C function returning an int,
with ints and bytes for arguments. Stdlib only, Python 3.8."""
from __future__ import annotations

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Callable

FUNC: list[Any] = []   # the function pointer's class, made once


def function(name: str) -> Callable[..., int]:
    """libc's `name` (this process's own libc: dlopen(NULL)). ImportError without
    _ctypes, OSError when libc has no such function."""
    import _ctypes
    if not FUNC:
        class CInt(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_int
            _type_ = "i"

        class Func(_ctypes.CFuncPtr):   # a cdecl function returning an int
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = CInt
        FUNC.append(Func)
    libc = _ctypes.dlopen(None)  # type: ignore[arg-type]  # (None: this process's own)
    fn: Callable[..., int] = FUNC[0](_ctypes.dlsym(libc, name))
    return fn
