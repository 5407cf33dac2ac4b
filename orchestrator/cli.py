"""`orch`: parse the command line, run one command, turn every OrchError into one
message and its exit code (SPEC: 0 ok, 1 job failed, 2 usage/inventory, 3 host, 130 Ctrl-C;
and 141, as the shell reports a tool that SIGPIPE ended, when stdout's reader went away)."""
from __future__ import annotations

import argparse
import difflib
import json
import signal
import sys
from types import FrameType
from typing import Any, Callable, NoReturn

from orchestrator import __version__
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_USAGE, OrchError
from orchestrator.ssh import lazyimport
from orchestrator.ui.console import (
    STDOUT_CLOSED,
    guard_std_streams,
    new_command,
    note_interrupt,
    stop_interrupting,
    warnings_to_console,
)

lazyimport.hold_back()   # before anything imports paramiko

EXIT_PIPE = 141   # 128 + SIGPIPE: `orch logs | head -2`, once head has read its lines
JSON_VERSION = 1   # api.outcomes.JSON_VERSION (tests/test_api.py checks they agree)

# `orch COMMAND`: its module under orchestrator/commands/ and its line in `orch --help`.
# Only the named command's module is imported and its arguments defined (pip does the
# same): the others' imports would cost every start, `--help` and a broken inventory too.
COMMANDS = {
    "up": ("up", "preflight, sync, start the job on every host, follow it"),
    "stop": ("stop", "stop every process of the job on every host"),
    "logs": ("logs", "print a rank's output (or every rank's, prefixed)"),
    "status": ("status", "per-rank state of the job"),
    "results": ("results", "a job array's results: one row per task, then grouped over folds"),
    "pull": ("pull", "bring files back from a host's job output/ folder"),
    "exec": ("exec", "run a command on every host (or --hosts) in the job folder"),
    "split-data": ("split_data", "split a dataset into one shard (folder of links) per worker"),
    "forward": ("forward", "forward a local port to a port on a job's host over orch's SSH"),
    "dashboard": ("dashboard", "the job's live page in a browser (127.0.0.1, behind a token)"),
}


class Parser(argparse.ArgumentParser):
    json_requested = False   # --json was on the command line: a usage error is a JSON document too

    def error(self, message: str) -> NoReturn:  # argparse's own exit code is 2, as SPEC's
        self.print_usage(sys.stderr)
        sys.stderr.write(f"orch: error: {message}{self.suggestion(message)}\n")
        json_error(argparse.Namespace(json=Parser.json_requested), message, EXIT_USAGE)
        sys.exit(EXIT_USAGE)

    def suggestion(self, message: str) -> str:
        """`orch stauts` -> did you mean `status`; `up --detatch` -> `--detach`."""
        if "invalid choice: " in message:
            word, choices = message.split("invalid choice: ", 1)[1].split("'")[1], []
            for action in self._actions:
                choices += list(getattr(action, "choices", None) or [])
        elif message.startswith("unrecognized arguments: "):
            word = message.split(": ", 1)[1].split()[0]
            choices = [o for a in self._actions for o in a.option_strings]
        else:
            return ""
        close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
        if close and close[0] == word:   # a known option before its command: `orch --json status`
            return f"\n  options go after the command: `{self.prog} {word} ...`"
        return f"\n  did you mean `{close[0]}`?" if close else ""


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Every command is listed; the `chosen` one (the first word that is not an option:
    the top level has only --help and --version, which take no value) gets its arguments."""
    from importlib import import_module
    parser = Parser(prog="orch", description="SSH launcher for PyTorch distributed training")
    parser.add_argument("--version", action="version", version=f"orch {__version__}")
    common = Parser(add_help=False)
    common.add_argument("-c", "--config", default="cluster.yaml", metavar="FILE",
                        help="inventory file (default: cluster.yaml)")
    common.add_argument("--json", action="store_true",
                        help="one JSON document on stdout (messages stay on stderr)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    class WithCommon:
        """Every sub-command gets -c/--config and --json."""

        def add_parser(self, name: str, **kw: Any) -> Parser:
            return sub.add_parser(name, parents=[common], help=COMMANDS[name][1], **kw)
    for name, (module, summary) in COMMANDS.items():
        if name == chosen:
            import_module(f"orchestrator.commands.{module}").add_parser(WithCommon())
        else:
            sub.add_parser(name, help=summary)
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but an unknown option is reported with its own command's usage
    (`orch up --detatch` shows `usage: orch up ...`), not the top-level one."""
    words = sys.argv[1:] if argv is None else argv
    Parser.json_requested = "--json" in words
    parser = build_parser(next((w for w in words if not w.startswith("-")), None))
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP (a closed terminal) act like Ctrl-C: the job is stopped, not
    orphaned. A signal ignored when orch started stays ignored: `nohup orch up` must
    outlive its terminal. Each is noted as the command's interruption, so that a closed
    stdout does not interrupt what it does about it (ui/console.py); a hang-up after the
    first interruption is not one more: the terminal closing mid-stop ends no stop."""
    def handler(signum: int, frame: FrameType | None) -> None:
        if not note_interrupt() and signum == signal.SIGHUP:
            return
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, handler)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not a `cmd &`'s
        signal.signal(signal.SIGINT, handler)


def json_error(args: argparse.Namespace, message: str, code: int) -> int:
    """Under --json a failure is still a JSON document on stdout (and its message on stderr)."""
    if getattr(args, "json", False):
        # the version of every document (api/outcomes.py), written out: importing the api
        # here would cost every `orch --help` and usage error its imports
        doc = {"version": JSON_VERSION, "error": message, "exit_code": code}
        try:
            sys.stdout.write(json.dumps(doc) + "\n")
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            pass
    return code


def cli(argv: list[str] | None = None) -> int:
    args = parse(argv)
    new_command()
    interrupt_on_termination()
    warnings_to_console()
    run: Callable[[argparse.Namespace], int] = args.func
    try:
        return run(args)
    except OrchError as e:
        if STDOUT_CLOSED.is_set():   # what the interruption left half done (exec, up)
            return EXIT_PIPE
        sys.stderr.write(f"orch: {e}\n")
        return json_error(args, str(e), e.exit_code)
    except KeyboardInterrupt:
        if STDOUT_CLOSED.is_set():   # the reader of our output left: nothing to say
            return EXIT_PIPE
        sys.stderr.write("orch: interrupted\n")
        return json_error(args, "interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:   # a stdout that is not guarded (cli() called, not main())
        return EXIT_PIPE


# How long a thread may hold the GIL while another waits for it. orch's threads (one per
# host, and paramiko's per connection) wait on the network, not on each other; with
# Python's 5 ms each thread waiting for the GIL woke 200 times a second to ask for it,
# which at 300 hosts was most of orch's system time (at 50 ms: a quarter of the wake-ups,
# half the system time, measured by bench/fleet_profile.py). Set by the `orch` command
# only: a program that imports the api keeps its own.
SWITCH_INTERVAL_S = 0.05


def main() -> NoReturn:
    """The `orch` command: `cli()`, then the process's end without the interpreter's
    teardown, once the command is done: what a normal exit does that matters (threads
    joined, atexit handlers, output flushed), not the freeing of every module (paramiko,
    cryptography, rich): at the end of an `orch up`, 0.25 s on a loaded machine after its
    last line."""
    from orchestrator.agent.launcher import end_now  # the warm torchrun ends the same way
    # a closed stdout is the user's pipe, never a host: guarded here, once, for every
    # command and every thread that prints (ui/console.py)
    guard_std_streams()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        code = cli()
        stop_interrupting()
    except KeyboardInterrupt:   # stdout closed as the command returned: nothing to say
        stop_interrupting()
        code = EXIT_PIPE if STDOUT_CLOSED.is_set() else EXIT_INTERRUPTED
    # the command is over: a Ctrl-C now, or a closed stdout's interrupt still pending,
    # must not cut the process's end short with a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    end_now(EXIT_PIPE if STDOUT_CLOSED.is_set() else code)


if __name__ == "__main__":
    main()
