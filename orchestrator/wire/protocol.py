"""The wire between the controller and the agent on a host: every message.

Both sides import this module (the agent receives it in its bundle), so no message
string is written anywhere else. Python 3.8, stdlib only.

The frames that carry the messages are frames.py's (kinds, caps, MAGIC, the reader);
they are named here too, so that both sides say `protocol.` for the whole wire. A
message is a JSON frame whose "t" names it: a request, its reply (or error, after any
parts), an event, an item of a stream; each has a schema below, checked on arrival.
"""
from __future__ import annotations

from orchestrator.wire import globs, timeouts
from orchestrator.wire.frames import CAPS as CAPS
from orchestrator.wire.frames import DATA as DATA
from orchestrator.wire.frames import HEADER as HEADER
from orchestrator.wire.frames import JSON as JSON
from orchestrator.wire.frames import MAGIC as MAGIC
from orchestrator.wire.frames import MAX_DATA as MAX_DATA
from orchestrator.wire.frames import MAX_GARBAGE as MAX_GARBAGE
from orchestrator.wire.frames import MAX_JSON as MAX_JSON
from orchestrator.wire.frames import MAX_OUTPUT as MAX_OUTPUT
from orchestrator.wire.frames import OUTPUT as OUTPUT
from orchestrator.wire.frames import PARTIAL as PARTIAL
from orchestrator.wire.frames import RANK as RANK
from orchestrator.wire.frames import STREAM_OUT as STREAM_OUT
from orchestrator.wire.frames import FrameReader as FrameReader
from orchestrator.wire.frames import Garbage as Garbage
from orchestrator.wire.frames import ProtocolError as ProtocolError
from orchestrator.wire.frames import command_output as command_output
from orchestrator.wire.frames import decode as decode
from orchestrator.wire.frames import frame as frame
from orchestrator.wire.frames import hello as hello
from orchestrator.wire.frames import message as message
from orchestrator.wire.frames import output as output
from orchestrator.wire.frames import split_output as split_output

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, Mapping, TypeVar
    Obj = TypeVar("Obj", bound=Mapping[str, Any])   # check() hands back what it was given

MANIFEST_PART = 20_000               # manifest entries per part, at most
MAX_PARTS = 100                      # parts before one reply: 2 million files per folder
MAX_PULL_FILES = 200_000             # files one pull may list (name the PATHs for more)
MAX_PULL_SIZE = 1 << 40              # one pulled file: 1 TiB at most
MAX_PULL_PATH = 1024                 # bytes of a pulled file's path (each part: 255)
MAX_PULL_NOTES = 50                  # skipped entries named in a pull manifest's reply
MAX_RESTORE_FILES = 10_000           # checkpoint files one restore puts back
MAX_COMMANDS = 200                   # setup commands in one request

# Error categories of an error reply, and the exit code the controller gives them.
USAGE, HOST, JOB = "usage", "host", "job"
EXIT_CODES = {USAGE: 2, "inventory": 2, HOST: 3, JOB: 1}


# ---------------------------------------------------------------- messages
#
# A schema maps field -> spec; "?name" is optional. A spec is a type or tuple of types,
# a one-element list [spec] (a list of those), a nested schema dict, or a function
# returning an error text or None.

NUM = (int, float)
OPT_NUM = (int, float, type(None))
OPT_INT = (int, type(None))
OPT_STR = (str, type(None))


def manifest_files(value: Any) -> str | None:
    if not isinstance(value, dict):
        return "must be an object"
    if len(value) > MANIFEST_PART:
        return "has %d entries, more than %d" % (len(value), MANIFEST_PART)
    for rel, entry in value.items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and isinstance(entry[1], str)):
            return "entry %r must be [size, sha256]" % rel
    return None


def manifest_token(entries: Any) -> str:
    """One digest of a folder's manifest: its (path, sha256 or "link:<target>") pairs in
    path order. Both sides compute it, the controller over what the folder must hold,
    the host over what it holds: equal tokens mean a push would send and delete nothing,
    so the host sends the token instead of the entries. NUL ends every field (no path,
    digest or link target can hold one): two different manifests never give the same
    bytes to hash."""
    pairs = sorted(entries)
    return sorted_token([p[0] for p in pairs], [p[1] for p in pairs])


def sorted_token(paths: list[str], digests: list[str]) -> str:
    """manifest_token of paths already in path order (distinct, as a folder's are) and
    their digests: the host's ledger has them so at the end of a receive, and a list
    per field is built without a tuple per file."""
    import hashlib  # here: the agent's start does not pay for it
    h, nul, step = hashlib.sha256(), "\0", 65536
    for i in range(0, len(paths), step):   # an encode and an update per 65536, not per file
        part = paths[i:i + step]
        fields: list[str] = [""] * (2 * len(part))
        fields[0::2], fields[1::2] = part, digests[i:i + step]   # interleaved at C speed
        text = nul.join(fields) + nul   # "rel\0digest\0" each
        h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def token_map(value: Any) -> str | None:
    if not isinstance(value, dict) or len(value) > 2 or \
            not all(k in ("code", "data") and isinstance(v, str) for k, v in value.items()):
        return "must map code and data to manifest tokens"
    return None


GLOBS_OK: set[tuple[str, ...]] = set()   # glob lists found good (at most GLOBS_KNOWN)
GLOBS_KNOWN = 64


def glob_list(value: Any) -> str | None:
    """A keeper's globs, relative to the folder asked for (wire/globs.py). A list found
    good is known: the curves' follow and listings send the same few at every request
    (2,000 checks of each glob at 1,000 hosts)."""
    if not isinstance(value, list) or len(value) > globs.MAX_GLOBS:
        return "must be a list of at most %d globs" % globs.MAX_GLOBS
    key = tuple(value) if all(type(rest) is str for rest in value) else None
    if key in GLOBS_OK:
        return None
    for rest in value:
        why = globs.problem("output/%s" % rest) if isinstance(rest, str) else "not text"
        if why:
            return "glob %r: %s" % (str(rest)[:100], why)
    if key is not None and len(GLOBS_OK) < GLOBS_KNOWN:
        GLOBS_OK.add(key)
    return None


def restore_files(value: Any) -> str | None:
    """{rel: [size, sha256]}: kept checkpoints, relative to the job folder (output/, code/)."""
    if not isinstance(value, dict) or len(value) > MAX_RESTORE_FILES:
        return "must be an object of at most %d files" % MAX_RESTORE_FILES
    for rel, entry in value.items():
        why = pull_path_problem(rel) or ("" if rel.split("/", 1)[0] in globs.FOLDERS
                                         and "/" in rel else "not under output/ or code/")
        if why:
            return "path %r: %s" % (rel[:100], why)
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and isinstance(entry[1], str)):
            return "entry %r must be [size, sha256]" % rel[:100]
    return None


def gpu_want(value: Any) -> str | None:
    """A claim: a count, "all", or GPU indexes."""
    if isinstance(value, bool):
        return "must be a count, \"all\" or a list of GPU indexes"
    if isinstance(value, int) or value == "all":
        return None
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in value):
        return None
    return "must be a count, \"all\" or a list of GPU indexes"


def beat_period(value: Any) -> str | None:
    """A follow's heartbeat period: seconds within timeouts.HEARTBEAT-HEARTBEAT_MAX."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number of seconds"
    if not timeouts.HEARTBEAT <= value <= timeouts.HEARTBEAT_MAX:
        return "must be %g-%g s, got %r" % (timeouts.HEARTBEAT, timeouts.HEARTBEAT_MAX, value)
    return None


GPU_PROC = {"pid": int, "mem": OPT_NUM, "user": str}
GPU = {"index": int, "uuid": str, "name": str, "util": OPT_NUM, "mem_used": OPT_NUM,
       "mem_total": OPT_NUM, "holder": (dict, type(None)), "procs": [GPU_PROC]}

REQUESTS: dict[str, dict[str, Any]] = {
    # warm: where the host's own checks pass, torchrun starts warm (env: the ranks')
    "preflight": {"job_dir": str, "master_port": int, "want_port": bool,
                  "folders": [str], "want_gpus": bool, "?warm": {"env": dict},
                  # share: write the marker .orch-share-<nonce> (this index) unless there
                  # is one; the reply's share_leader names whose marker the host found
                  "?share": {"nonce": str, "index": int},
                  # gpus: claim these GPUs (agent/gpus.py) for the job's life; the reply's
                  # gpu_ids are those taken, or gpu_busy lists every GPU and its holder
                  "?gpus": gpu_want,
                  # expect: {folder: manifest_token of what the controller will push}; a
                  # folder that holds exactly that sends a part with `same` and no entries
                  "?expect": token_map,
                  # net: learn this host's network, listen for the probe (agent/network.py)
                  "?net": {"toward": str, "token": str, "listen": bool, "master": bool}},
    # the network probe: connect to each target, read its token (agent/network.py)
    "net_probe": {"targets": [{"addr": str, "port": int, "token": str, "group": str}],
                  "bound": NUM},
    "net_close": {},
    # after the launch: the job's connections that get no answer (a network hang)
    "net_waits": {"job_dir": str},
    # after the launch: one listener again, for the check of who reaches this host
    "net_listen": {"token": str},
    # orch up --wait: claim again, trying for up to wait_s; release: let go of them all
    "gpu_claim": {"job_dir": str, "want": gpu_want, "wait_s": NUM},
    "gpu_release": {"job_dir": str},
    "unshare": {"job_dir": str, "nonce": str},        # remove that marker
    "manifest": {"root": str},
    "receive": {"root": str},
    # unshare: the nonce of the marker this host's preflight left, removed first
    "launch": {"job_dir": str, "spec": {"run_id": str, "ranks": [int], "argv": [str],
                                        "env": dict}, "?unshare": str},
    # heartbeats: also watch each rank's heartbeat file (run/heartbeat-<r>) and send a
    # `progress` event naming the ranks whose file was touched since the last one;
    # beat: the `beat` event's period in seconds (timeouts.heartbeat: slower for many hosts)
    # curves (mode "events"): the `done` event says how many files under output/ these
    # globs match (the curves' files: no last listing of a host that has none)
    "follow": {"job_dir": str, "ranks": [int], "tail": int, "mode": str, "?unit": str,
               "?heartbeats": bool, "?beat": beat_period, "?curves": glob_list},
    "status": {"job_dir": str, "ranks": [int], "?first_local": int,
               "?gpus": bool},   # gpus: every GPU's facts and holder too (the GPU view)
    "stop": {"job_dir": str, "grace": NUM},
    # job arrays: a runner per host works through its queue of tasks
    # gpus, gpus_per_task: slot s runs on gpus[s*g:(s+1)*g] (CUDA_VISIBLE_DEVICES)
    "array_launch": {"job_dir": str, "spec": {"run_id": str, "slots": int, "env": dict,
                                              "tasks": [{"i": int, "argv": [str], "args": str}],
                                              "?gpus": [int], "?gpus_per_task": int}},
    "array_status": {"job_dir": str, "tasks": [int]},
    "array_results": {"job_dir": str, "tasks": [int]},
    # paths relative to the folder (output/ unless `folder`: "output", "code", or
    # "checkpoints", the keeper host's copy: globs.KEEP); globs
    # (the checkpoint keeper): only the files they match, none written in the last `settle` s;
    # `max_size` (the curves' fetch): a bigger file is named, never hashed
    "pull_manifest": {"job_dir": str, "paths": [str], "?folder": str, "?globs": glob_list,
                      "?settle": NUM, "?max_size": int},
    "pull_send": {"job_dir": str, "files": [str], "?folder": str},   # from the manifest
    # checkpoints put back before a (re)launch: which of these differ or are missing
    # there, then `restore` with the receive stream (`file` items, `end` with no deletion);
    # written beside and renamed, never recorded in code/'s ledger (agent/restore.py)
    "restore_check": {"job_dir": str, "files": restore_files},
    "restore": {"job_dir": str},
    # `job.checkpoint_to: host`: the receive stream into <job dir>/checkpoints/ (paths
    # output/... or code/...), recorded in its own ledger; `end` deletes only what orch
    # put there (agent/keep.py)
    "keep_receive": {"job_dir": str},
    "clock": {},                          # the host's time now: offsets measured NTP-style
    # setup: `commands` (each run with the host's shell, -c) or `script` (a file in code/),
    # in code/; skipped when run/setup.json holds `fingerprint` (unless `force`)
    "setup": {"job_dir": str, "commands": [str], "script": OPT_STR, "env": dict,
              "fingerprint": str, "force": bool,
              # shared: run once for every host of this job folder (run/shared-setup.json);
              # log: the output's file in logs/ (default setup.log)
              "?shared": bool, "?log": str},
    # after setup: the configured python's executable, torch version, and the entrypoint
    "probe": {"job_dir": str, "python": str, "entrypoint": str, "module": bool, "env": dict},
    # orch exec: argv in the job folder (else remote_dir, else home), no shell
    "exec": {"job_dir": str, "argv": [str], "env": dict},
    "cancel": {"request": int},     # end the command of a running setup or exec (its group)
    # a hang: each rank's Python stack (faulthandler on STACK_SIGNAL), or why it has none
    "stacks": {"job_dir": str, "ranks": [int], "reason": str},
}
FOLLOW_MODES = ("events", "snapshot", "raw", "raw-follow")
FOLLOW_UNITS = ("rank", "task")

SUPERVISOR = {"pid": int, "pgid": int, "start_ticks": OPT_INT, "torchrun_pid": int,
              "run_id": str, "started": NUM}
RANK_STATUS = {"rank": int, "state": str, "last_line": str, "?pid": OPT_INT,
               "?started": OPT_NUM, "?code": OPT_INT, "?ended": OPT_NUM, "?error_file": str,
               "?log_bytes": OPT_INT}
TASK_STATUS = {"task": int, "state": str, "last_line": str, "?pid": OPT_INT, "?slot": OPT_INT,
               "?started": OPT_NUM, "?code": OPT_INT, "?ended": OPT_NUM}
TASK_RESULT = {"task": int, "header": OPT_STR, "last": OPT_STR}
MAX_STACK = 32 << 10                 # the bytes of one rank's stack in a `stacks` reply
MAX_STACKS_REPLY = 4 << 20           # all of a host's stacks together
MAX_NOTES = 64                       # file names (NCCL dumps) in a `stacks` reply
# state: "answered" (stack holds its threads), "stopped" (SIGSTOP, a debugger: cannot
# answer), "disk-wait" (uninterruptible sleep), "no answer", "exited", "gone"
RANK_STACK = {"rank": int, "state": str, "pid": OPT_INT, "stack": str}


def stack_list(value: Any) -> str | None:
    if not isinstance(value, list):
        return "must be a list"
    total = 0
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("stack"), str):
            return "holds an entry that is not a rank's stack"
        total += len(item["stack"])
        if len(item["stack"]) > MAX_STACK or total > MAX_STACKS_REPLY:
            return "holds more than the stack limits (%d, %d)" % (MAX_STACK, MAX_STACKS_REPLY)
        check(item, RANK_STACK, "stack")
    return None


def name_list(value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > MAX_NOTES:
        return "must be a list of at most %d names" % MAX_NOTES
    if not all(isinstance(v, str) and len(v) <= 255 for v in value):
        return "must hold names of at most 255 characters"
    return None
MAX_NET_WAITS = 32                   # waiting connections in a `net_waits` reply
NET_WAIT = {"rank": OPT_INT, "pid": int, "local": str, "addr": str, "port": int, "tries": int}


def net_waits(value: Any) -> str | None:
    if not isinstance(value, list) or len(value) > MAX_NET_WAITS:
        return "must be a list of at most %d connections" % MAX_NET_WAITS
    for item in value:
        if not isinstance(item, dict):
            return "holds an entry that is not a connection"
        check(item, NET_WAIT, "connection")
    return None


# a host's network as preflight learnt it (agent/network.learn)
NET_IFACE = {"name": str, "addrs": [str], "up": bool}
NET_FACTS = {"hostname": str, "resolves": [str], "route_src": str, "boot_id": str,
             "interfaces": [NET_IFACE], "env": dict,
             "?port": int, "?master_listen": int}
REPLIES: dict[str, dict[str, Any]] = {
    "preflight": {"python": str, "executable": str, "torch": OPT_STR, "job_dir": str,
                  "gpus": int, "writable": OPT_STR, "time": NUM, "hostname": str,
                  # held: another agent holds the job folder's lock (an `up` under way)
                  "ssh_connection": str, "running": bool, "?held": bool,
                  "?port": int, "?port_free": bool,
                  "?python_missing": str, "?share_leader": int, "?gpu_ids": [int],
                  "?gpu_uuids": [str], "?gpu_busy": [GPU], "?gpu_error": str, "?net": NET_FACTS},
    "net_probe": {"results": [{"ok": bool, "why": str, "src": str, "ms": NUM}]},
    "net_close": {"closed": int},
    # fails: the kernel's failed TCP connects in the job's network namespace(s)
    "net_waits": {"waits": net_waits, "interfaces": [NET_IFACE], "?fails": int},
    "net_listen": {"port": int},
    "manifest": {"root": str},                            # the files come as parts
    "receive": {"files": int, "bytes": int, "deleted": int},
    "launch": {"supervisor": SUPERVISOR},
    "follow": {},
    # nccl_dumps (when a rank of the reply failed): as in stacks' reply below
    "status": {"supervisor": (dict, type(None)), "host_exit": (dict, type(None)),
               "time": NUM, "ranks": [RANK_STATUS], "?gpus": [GPU], "?gpu_error": str,
               "?nccl_dumps": name_list},
    "stop": {"found": int, "killed": int, "left": [int], "seconds": NUM},
    "pull_manifest": {"root": str, "files": int, "bytes": int,
                      "skipped": [{"p": str, "why": str}], "skipped_count": int,
                      "?fresh": int, "?fresh_paths": name_list},
    "pull_send": {"files": int, "bytes": int},
    "restore_check": {"want": [str]},
    "restore": {"files": int, "bytes": int},
    "keep_receive": {"files": int, "bytes": int, "deleted": int},
    "clock": {"time": NUM},
    "array_launch": {"supervisor": SUPERVISOR},
    "array_status": {"supervisor": (dict, type(None)), "host_exit": (dict, type(None)),
                     "time": NUM, "tasks": [TASK_STATUS]},
    "array_results": {"tasks": [TASK_RESULT]},
    # code: the exit status (negative: killed by that signal); failed: the command that failed
    "setup": {"skipped": bool, "code": int, "failed": OPT_STR, "shell": str, "seconds": NUM},
    "probe": {"executable": OPT_STR, "torch": OPT_STR, "entrypoint": OPT_STR, "error": OPT_STR},
    "exec": {"code": int, "cwd": str, "seconds": NUM},
    "cancel": {"found": bool},
    "unshare": {"removed": bool},
    "gpu_claim": {"?ids": [int], "?uuids": [str], "?busy": [GPU]},
    "gpu_release": {"released": bool},
    # nccl_dumps: NCCL flight recorder files in this host's run/ (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)
    "stacks": {"ranks": stack_list, "nccl_dumps": name_list, "time": NUM},
}
# Parts that may come before a reply (with the request's id).
PARTS = {"manifest": {"folder": str, "files": manifest_files, "?same": str}}
EVENTS: dict[str, dict[str, Any]] = {
    # a rank ended (host clock); after_stop: it ended after this host received a stop,
    # so it is a consequence of the stop, never a job's root cause
    "exit": {"rank": int, "code": OPT_INT, "time": NUM, "?after_stop": bool},
    "start": {"rank": int, "pid": int},                   # a rank's process is there
    "done": {"code": OPT_INT, "?time": OPT_NUM, "?lost": bool, "?snapshot": bool,
             "?after_stop": bool, "?curves": int},
    "beat": {"?time": NUM},   # after a follow's `beat` seconds without a frame (host clock)
    "progress": {"ranks": [int]},             # these ranks touched their heartbeat file
}
ERROR = {"category": str, "message": str, "?traceback": str, "?fix": str}
# A pull_send's stream, before its reply: per file a `pull_file` part, its data frames
# (exactly "s" bytes), then `pull_end` with the sha256 of the bytes sent ("" when the
# file changed size while it was read); `pull_skip` for a file that could not be opened.
PULL_STREAM: dict[str, dict[str, Any]] = {"pull_file": {"p": str, "s": int, "m": int},
               "pull_end": {"p": str, "h": str},
               "pull_skip": {"p": str, "why": str}}
# The receive stream, after the receive request.
# `fresh`: true when each sha256 was taken by the controller from the very bytes that
# follow, as it read them for this stream (a first push): the host need not hash them
# again (SSH's MAC guards them on the way). Without it the host verifies each digest: a
# digest from the controller's cache may be of bytes that changed since.
STREAM: dict[str, dict[str, Any]] = {"file": {"p": str, "s": int, "h": str, "m": int,
                                              "?fresh": bool},
          "link": {"p": str, "link": str},
          # small files: f = [[path, size, sha256, mode], ...] (MAX_BATCH_FILES at most),
          # then one data frame of their bytes end to end when any has a byte (receive only)
          "files": {"f": list, "?fresh": bool},
          "end": {"delete": [str]}}
# The controller gives up on a stream it started (a local file it cannot read, half
# way through its bytes too): `abort` ends it instead of `end`; the host keeps what
# landed and answers with an error (agent/streams.py).
STREAM_ABORT = {"why": str}
MAX_BATCH_FILES = 4096


def pull_path_problem(rel: Any) -> str:
    """Why `rel` cannot be a pulled file's path (relative to output/), or "" when it can.
    Both sides ask: the host skips such a file, the controller refuses a host that sends
    one. Any name a POSIX file system holds is pulled, byte for byte: a line break, an
    escape, a backslash or bytes that are not UTF-8 (they travel as the surrogates
    os.fsdecode makes, escaped in JSON, and are shown escaped). Refused: an absolute path,
    an empty, . or .. part, a NUL, a name over 255 bytes, and the names orch gives its
    half-written files."""
    if not isinstance(rel, str) or not rel:
        return "an empty path"
    try:
        raw = rel.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:   # a surrogate that no byte decodes to
        return "a name no file system holds"
    parts = raw.split(b"/")
    if len(raw) > MAX_PULL_PATH or any(len(p) > 255 for p in parts):
        return "a path longer than %d bytes (or a name longer than 255)" % MAX_PULL_PATH
    if b"\0" in raw:
        return "a NUL in the name"
    if any(p in (b"", b".", b"..") for p in parts):
        return "not a plain relative path"
    if b".orch-part-" in raw:   # agent/paths.PART (wire/ imports no agent module)
        return "a name orch gives its half-written files"
    return ""


def _type_name(spec: Any) -> str:
    types = spec if isinstance(spec, tuple) else (spec,)
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def check_value(value: Any, spec: Any, where: str) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ProtocolError("%s must be an object" % where)
        check(value, spec, where)
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise ProtocolError("%s must be a list" % where)
        for i, item in enumerate(value):
            check_value(item, spec[0], "%s[%d]" % (where, i))
    elif callable(spec) and not isinstance(spec, type):
        problem = spec(value)
        if problem:
            raise ProtocolError("%s %s" % (where, problem))
    else:
        types = spec if isinstance(spec, tuple) else (spec,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise ProtocolError("%s must be %s, got %s" % (where, _type_name(spec),
                                                           type(value).__name__))


def check(obj: Obj, schema: dict[str, Any], what: str) -> Obj:
    """obj, if it has every field of schema with the right types; else ProtocolError
    naming `what` and the field."""
    for key, spec in schema.items():
        name = key.lstrip("?")
        if name not in obj:
            if key.startswith("?"):
                continue
            raise ProtocolError("%s: field %r is missing" % (what, name))
        if type(obj[name]) is spec and spec is not bool:
            continue   # the common case, without the error's text (a receive: per file)
        check_value(obj[name], spec, "%s: field %r" % (what, name))
    return obj


def request(t: str, id: int, **fields: Any) -> bytes:
    check(fields, REQUESTS[t], "request " + t)
    return message(t, id=id, **fields)


def reply(id: int | None, body: dict[str, Any]) -> bytes:
    return message("reply", id=id, body=body)


def part(id: int | None, kind: str, body: dict[str, Any]) -> bytes:
    return message("part", id=id, kind=kind, body=body)


def error(id: int | None, category: str, text: str, traceback: str = "", fix: str = "") -> bytes:
    fields = {"category": category, "message": text}
    if fix:
        fields["fix"] = fix[:800]
    if traceback:
        fields["traceback"] = traceback[-8000:]
    return message("error", id=id, **fields)


def event(t: str, **fields: Any) -> bytes:
    check(fields, EVENTS[t], "event " + t)
    return message(t, **fields)


def stream_item(t: str, **fields: Any) -> bytes:
    return message(t, **fields)
