"""`job:` in cluster.yaml: what torchrun runs on every host (entrypoint, args, env, port,
restarts; `array:` is arrayspec.py's). Called by inventory.py with the section, the
names of the pushed code paths and the most procs of any host.

- A script entrypoint (`job/train.py`) must be inside one of code.paths when any are
  given; a module entrypoint whose top package is pushed must exist in it.
- `args` and `env` values are passed exactly as written (`5`, `1e-5`, `yes` stay as
  typed); `args` may also be one string, split like a shell. Their total is capped.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from yaml.nodes import Node, ScalarNode

from orchestrator.config.arrayspec import ArraySpec, parse_array
from orchestrator.config.yamlnodes import TAG, Section, Source, exists, scalar_text, short
from orchestrator.wire import globs

JOB_KEYS = ("entrypoint", "args", "env", "master_port", "max_restarts", "hang_timeout", "array",
            "restarts", "min_hosts", "checkpoint", "checkpoint_to")
MAX_RESTARTS = 1000
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GROUP_RANK")
MAX_JOB_BYTES = 256 << 10  # job.args and job.env together (a command line holds ~2 MiB)
_MODULE_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what worker.train writes (worker/checkpoint.py: epoch-NNNNN.pt, written beside and renamed)
DEFAULT_CHECKPOINT = ("output/checkpoints/*.pt",)
CHECKPOINT_TO = ("controller", "host")   # where the kept copy lives (session/hostkeep.py)
# keys whose empty value (`key:` alone) would silently mean something else: refused
EMPTY_FIXES = {
    "args": "write `args: []` for none, or delete the line",
    "env": "write `env: {}` for none, or delete the line",
    "hang_timeout": "give the seconds (`hang_timeout: 300`), or delete the line to leave the "
                    "hang watch off",
    "min_hosts": "give a number of hosts (`min_hosts: 2`), or delete the line: every host is needed",
    "checkpoint": "write `checkpoint: []` to keep nothing, or delete the line for the default "
                  f"({DEFAULT_CHECKPOINT[0]})",
}


@dataclass(frozen=True)
class JobSpec:
    """What torchrun runs on every host."""

    entrypoint: str              # dotted module name, or a relative path ending in .py
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted by key
    master_port: int | None   # None: a free port on the first host
    max_restarts: int
    array: ArraySpec | None = None   # a job array: independent tasks instead of one job
    restarts: int = 0                # whole-job restarts after a failure (api/healing.py)
    min_hosts: int | None = None     # with no spare left, go on with at least this many hosts
    hang_timeout: float | None = None  # seconds without progress before a hang; None: off
    # globs relative to the job folder (wire/globs.py): kept off rank 0's host, put back
    # at a restart (session/checkpoints.py)
    checkpoint: tuple[str, ...] = DEFAULT_CHECKPOINT
    # where the copy lives: "controller" (.orch/<name>/checkpoints/) or "host" (another
    # host of the job, relayed through the controller)
    checkpoint_to: str = "controller"

    @property
    def is_module(self) -> bool:
        return not self.entrypoint.endswith(".py")


def parse_job(sec: Section, pushed: dict[str, Path], max_procs: int) -> JobSpec:
    """The checked `job:` section; `pushed`: each code path's name -> its local path."""
    for key, fix in EMPTY_FIXES.items():
        sec.refuse_empty(key, fix)
    entrypoint = _entrypoint(sec)
    _check_entrypoint_pushed(sec, entrypoint, pushed)
    args = _args(sec)
    env = _env(sec, sum(len(a.encode()) + 1 for a in args))
    array = parse_array(sec, max_procs)
    hang = sec.number("hang_timeout", None)
    if array is not None:
        _refuse_with_array(sec)
    return JobSpec(entrypoint=entrypoint, args=args, env=env,
                   master_port=sec.integer("master_port", None, 1, 65535, example=29500),
                   max_restarts=sec.integer("max_restarts", 0, 0, MAX_RESTARTS, example=0),
                   array=array, hang_timeout=hang,
                   restarts=sec.integer("restarts", 0, 0, MAX_RESTARTS, example=3),
                   min_hosts=sec.integer("min_hosts", None, 1, example=2),
                   checkpoint=_checkpoint(sec),
                   checkpoint_to=sec.choice("checkpoint_to", CHECKPOINT_TO, "controller"))


# what acts on one distributed job only: with `array:` it would silently do nothing
ONE_JOB_ONLY = {
    "hang_timeout": "watches the ranks of one distributed job",
    "restarts": "restarts one distributed job after a failure",
    "min_hosts": "lets a restarted distributed job go on with fewer hosts",
    "checkpoint": "is what a restarted distributed job carries across",
    "checkpoint_to": "is where a restarted distributed job's checkpoints are kept",
}


def _refuse_with_array(sec: Section) -> None:
    for key, does in ONE_JOB_ONLY.items():
        if sec.node(key) is not None:
            sec.src.fail(sec.key_line(key), f"`job.{key}` {does}; a job array's tasks are "
                         "independent, and it would do nothing", f"remove `{key}:`, or `array:` "
                         "to run one distributed job")


def _entrypoint(sec: Section) -> str:
    value = sec.text("entrypoint")
    node = sec.node("entrypoint")
    if value.endswith(".py"):
        pure = PurePosixPath(value)
        if value.startswith(("~", "-")) or pure.is_absolute() or ".." in pure.parts:
            sec.src.fail(node, f"`job.entrypoint` {short(value)!r} must be a path inside the synced code folder",
                         "write it relative to the code folder, where code.paths keep their names "
                         "(e.g. `job/train.py`), without `..`")
        return str(pure)
    if not _MODULE_RE.fullmatch(value):
        sec.src.fail(node, f"`job.entrypoint` {short(value)!r} is neither a module name nor a .py script",
                     "write a module like `worker.train` (run with -m) or a script path like `job/train.py`")
    return value


def _check_entrypoint_pushed(sec: Section, entrypoint: str, pushed: dict[str, Path]) -> None:
    """Catch a typo locally: the entrypoint must be in what is pushed, when it would come from there."""
    if not pushed:
        return  # nothing pushed: the entrypoint is already on the hosts
    if entrypoint.endswith(".py"):
        first, *rest = PurePosixPath(entrypoint).parts
        where = "in code.paths"
        found = first in pushed and exists(sec.src, sec.node("entrypoint"),
                                            pushed[first].joinpath(*rest), file=True)
    else:
        first, *rest = entrypoint.split(".")
        where = f"in the pushed {first!r}"
        if first + ".py" in pushed and not rest:
            return
        if first not in pushed:
            return  # an installed package: preflight finds it, or the job fails on import
        module = pushed[first].joinpath(*rest)
        node = sec.node("entrypoint")
        found = exists(sec.src, node, module.with_name(module.name + ".py"), file=True) or \
            (exists(sec.src, node, module) and module.is_dir())
    if not found:
        near = difflib.get_close_matches(entrypoint, entrypoints(pushed, entrypoint.endswith(".py")),
                                         n=1, cutoff=0.6)
        sec.src.fail(sec.node("entrypoint"), f"`job.entrypoint` {short(entrypoint)!r} is not {where}",
                     f"did you mean `{near[0]}`?" if near else
                     "paths are relative to the synced code folder, where each code.paths entry "
                     f"keeps its name (pushed: {', '.join(sorted(pushed))})")


MAX_CANDIDATES = 5000   # files looked at for a did-you-mean: a huge code folder stays fast


def entrypoints(pushed: dict[str, Path], scripts: bool) -> list[str]:
    """What job.entrypoint could name in the pushed code: scripts (`job/train.py`) or
    modules (`worker.train`, a package with __main__.py as `worker`)."""
    found: list[str] = []
    for name, path in sorted(pushed.items()):
        if path.is_file() and name.endswith(".py"):
            found.append(name if scripts else name[:-3])
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            rel = PurePosixPath(name, Path(root).relative_to(path).as_posix())
            for f in sorted(f for f in files if f.endswith(".py")):
                if scripts:
                    found.append(str(rel / f))
                elif f in ("__init__.py", "__main__.py"):
                    found.append(".".join(rel.parts))
                else:
                    found.append(".".join((*rel.parts, f[:-3])))
            if len(found) > MAX_CANDIDATES:
                return found
    return found


def _args(sec: Section) -> tuple[str, ...]:
    node = sec.node("args")
    if node is None or node.tag == TAG + "null":
        return ()
    hint = "args are passed as text: write each as one value, quoted if needed"
    if isinstance(node, ScalarNode):
        try:
            return tuple(shlex.split(scalar_text(sec.src, node, "job.args", hint, verbatim=True)))
        except ValueError as exc:
            sec.src.fail(node, f"`job.args` cannot be split like a shell line: {exc}",
                         "close the quotes, or write args as a list: [--epochs, 5]")
    args: list[str] = []
    used = 0
    for i, item in enumerate(sec.src.sequence(node, "job.args")):
        args.append(scalar_text(sec.src, item, f"job.args[{i}]", hint, verbatim=True))
        used += len(args[-1].encode()) + 1
        _check_job_bytes(sec.src, sec.key_line("args"), used)  # an item may be an alias
    return tuple(args)


def _check_job_bytes(src: Source, where: Node | int, used: int) -> None:
    """args and env travel to every host and onto torchrun's command line or environment:
    their total is capped (checked item by item, as aliases can repeat a long value)."""
    if used > MAX_JOB_BYTES:
        src.fail(where, f"`job.args` and `job.env` hold more than {MAX_JOB_BYTES} bytes in all (the limit)",
                 "pass fewer or shorter values: put long contents in a file that the job reads")


def _env(sec: Section, used: int) -> tuple[tuple[str, str], ...]:
    node = sec.node("env")
    src = sec.src
    pairs = []
    for key, (key_node, value_node) in src.mapping(node, "job.env").items() if node is not None else ():
        if not _ENV_KEY_RE.fullmatch(key):
            src.fail(key_node, f"`job.env` key {short(key)!r} is not a valid variable name",
                     "use letters, digits and _, not starting with a digit")
        if key.startswith("ORCH_") or key in TORCHRUN_VARS:
            src.fail(key_node, f"`job.env` may not set {key}: orch or torchrun sets it for every rank",
                     "remove it (reserved: ORCH_*, " + ", ".join(TORCHRUN_VARS) + ")")
        value = scalar_text(src, value_node, f"job.env.{key}",
                            f'environment values are text: write `{key}: "..."`', verbatim=True)
        pairs.append((key, value))
        used += len(key) + len(value.encode()) + 2
        _check_job_bytes(src, key_node, used)
    return tuple(sorted(pairs))


def _checkpoint(sec: Section) -> tuple[str, ...]:
    """`job.checkpoint`: globs under output/ or code/ of the job folder (wire/globs.py);
    absent or null: worker.train's checkpoints."""
    node = sec.node("checkpoint")
    if node is None or node.tag == TAG + "null":
        return DEFAULT_CHECKPOINT
    hint = "write globs relative to the job folder, under output/ or code/ " \
           "(e.g. `output/checkpoints/*.pt`, `code/snapshot.pt`)"
    items = [node] if isinstance(node, ScalarNode) else sec.src.sequence(node, "job.checkpoint")
    if len(items) > globs.MAX_GLOBS:
        sec.src.fail(node, f"`job.checkpoint` holds {len(items)} globs, more than {globs.MAX_GLOBS}",
                     "match more files with fewer globs (`output/ckpt/*.pt`, `output/**/*.pt`)")
    out: list[str] = []
    for i, item in enumerate(items):
        value = scalar_text(sec.src, item, f"job.checkpoint[{i}]", hint)
        why = globs.problem(value)
        if why:
            sec.src.fail(item, f"`job.checkpoint` entry {short(value)!r}: {why}", hint)
        out.append(value)
    return tuple(dict.fromkeys(out))
