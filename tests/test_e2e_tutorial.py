"""docs/tutorial.md, run as written against two of the test suite's sshd hosts, with the
output the page shows compared with what orch prints.

The page's programs (train.py, crash.py) and its cluster.yaml are read out of it; only
the addresses, the login, the key files, the port and each host's remote_dir are the
fake hosts'. Then every command of the page runs in order, through bash as a reader
types it (`orch` on PATH, pipes and all): each `$ command` of a `console` block, whose
lines below are compared with what it printed (stdout and stderr as one stream), and
each `orch`/`sed` line of a `sh` block, which must exit 0 (`orch logs -f`, which follows
until the job ends, must print a rank's line, and is then ended with Ctrl-C as a reader
ends it). Before comparing, both sides are normalised: the fake hosts' addresses, port,
paths and python become the page's, and times, pids, ports, fingerprints and run ids
become placeholders. `...` on the page stands for any lines; a rank's lines
(`[r3 10.0.0.9] ...`) may come in any order. A message that changes fails here, not in
front of a reader.

`TUTORIAL_DUMP=FILE` writes what each command printed, normalised, into FILE (to
refresh the page after a deliberate change of a message)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from helpers import Jobs, assert_nothing_left, wait_until
from sshd_cluster import FakeHost, SshdCluster

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "tutorial.md"
ADDRESSES = ("10.0.0.8", "10.0.0.9")
# commands of `sh` blocks that the test runs (the others set up a real machine: keys, pip)
RUN = ("orch ", "sed ")
# a command that follows a running job until it ends (`-f`): ended by Ctrl-C once it
# printed a rank's line, or after this long (then it failed: it printed none)
FOLLOW_S = 120.0
# the exit code of each console command whose output starts with these words, else 0
EXIT_CODES = {"orch: 2 of 2 hosts failed preflight": 3, "orch: job 'hello' is already": 2,
              "[r3 10.0.0.9] rank 3: out of patience": 1}


@dataclass
class Step:
    """One command of the page, and for a `console` block the output it shows."""

    command: str
    shown: list[str] | None     # None: a `sh` line, output not shown
    line: int                   # where it is on the page


def steps(text: str) -> list[Step]:
    """Every command of the page in order: `$ ` lines of console blocks with the lines
    below them, and the RUN lines of sh blocks."""
    out: list[Step] = []
    for m in re.finditer(r"^```(console|sh)\n(.*?)^```", text, flags=re.S | re.M):
        first = text.count("\n", 0, m.start()) + 2
        for i, line in enumerate(m.group(2).splitlines()):
            if m.group(1) == "console" and line.startswith("$ "):
                out.append(Step(line[2:], [], first + i))
            elif m.group(1) == "console" and out and out[-1].shown is not None:
                out[-1].shown.append(line)
            elif m.group(1) == "sh" and line.startswith(RUN):
                command = re.sub(r"\s+# .*$", "", line)
                out.append(Step(command, None, first + i))
    return out


def blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


@dataclass
class Tutorial:
    """The fake hosts, the project folder, and what maps their text to the page's."""

    cluster: SshdCluster
    folder: Path
    known_hosts: Path
    subs: list[tuple[str, str]] = field(default_factory=list)

    def inventory(self, doc: dict, known_hosts: Path) -> None:
        """The page's cluster.yaml with the fake hosts' addresses, login, keys, port,
        remote_dirs and python (the page's python3 is the hosts' python with torch)."""
        doc["ssh"].update(user="root", identity_file=str(self.cluster.client_key),
                          known_hosts=str(known_hosts), port=self.cluster.port)
        for entry, host in zip(doc["hosts"], self.cluster.hosts):
            entry.update(address=host.address, remote_dir=str(host.remote_dir))
        doc["python"] = sys.executable
        (self.folder / "cluster.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))

    def normalise(self, text: str) -> list[str]:
        for old, new in self.subs:
            text = text.replace(old, new)
        rules = [
            (r"(MASTER_ADDR=[\w.]+):\d+", r"\1:PORT"),
            (r"SHA256:[A-Za-z0-9+/]{43}", "SHA256:FINGERPRINT"),
            (r"\b[0-9a-f]{32}\b", "RUNID"),
            (r"\b\d{8}-\d{6}\b", "DATE-TIME"),                 # an earlier run's folder
            (r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\b", "DATE TIME"),
            (r"\b\d+(\.\d+)?( ?)s\b", r"T\2s"),            # 12.4s, 0.6 s
            (r"\b\d+ process(es)?\b", "N processes"),
        ]
        for pattern, repl in rules:
            text = re.sub(pattern, repl, text)
        return [table_row(line) for line in text.rstrip("\n").splitlines()]


def table_row(line: str) -> str:
    """A table's line without what its widths depend on: pids, padding, rule lengths."""
    if re.match(r" {8,}\S", line):   # a table's title, centred over it
        return line.strip()
    if not re.search("[│┃┏┗┡└┌]", line):
        return line.rstrip()
    line = re.sub(r"(?<=[│┃] )\d{3,}(?= )", "PID", line)
    line = re.sub("([━─])[━─]*", r"\1", line)
    line = re.sub(r"\bstep \d+:", "step N:", line)   # status's last line: how far it got
    return re.sub(r" +", " ", line).strip()


def matches(shown: list[str], printed: list[str]) -> str:
    """'' when the page's lines match the printed ones, else what differs. Rank lines
    match in any order; the others in order, with `...` for any lines between; a block
    without `...` shows every line."""
    ranks = [line for line in printed if is_rank(line)]
    for line in (s for s in shown if is_rank(s)):
        if line not in ranks:
            return f"rank line not printed: {line!r}"
        ranks.remove(line)
    rest = [line for line in printed if not is_rank(line)]
    want = [s for s in shown if not is_rank(s)]
    if "..." not in want:
        if rest != want or ranks:
            return f"printed other lines: {rest!r} (and rank lines not shown: {ranks!r})"
        return ""
    at = 0
    for line in (s for s in want if s != "..."):
        try:
            at = rest.index(line, at) + 1
        except ValueError:
            return f"not printed (in this order): {line!r}"
    return ""


def run(tut: Tutorial, step: Step) -> tuple[int | None, str]:
    """The command through bash, in the project folder, with orch on PATH; a follow
    (`-f`) runs until it printed a rank's line and is then ended (exit None)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               COLUMNS="120", NO_COLOR="1", TERM="dumb")
    proc = subprocess.Popen(["bash", "-c", step.command], cwd=tut.folder,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    if " -f" in step.command:
        return None, follow(proc)
    try:
        out, _ = proc.communicate(timeout=300)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"`{step.command}` still running after 300 s:\n{out}") from None


def follow(proc: subprocess.Popen[str]) -> str:
    """What a follow printed until its first rank line (FOLLOW_S at most), when it is
    ended as a reader ends it: Ctrl-C. Waiting for that line, not a fixed time, is what
    shows it followed the job."""
    lines: list[str] = []
    ranked = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if is_rank(line):
                ranked.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ranked.wait(FOLLOW_S)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(30)
    reader.join(30)
    return "".join(lines)


def is_rank(line: str) -> bool:
    """A rank's line as orch prefixes it: `[r3 10.0.0.9] ...`."""
    return re.match(r"\[r\d+ ", line) is not None


def expected_code(step: Step) -> int:
    first = next((s for s in step.shown or [] if s != "..."), "")
    return next((code for words, code in EXIT_CODES.items() if first.startswith(words)), 0)


def prepare(cluster: SshdCluster, folder: Path) -> Tutorial:
    """The page's programs and inventory in the project folder; its known_hosts empty
    until the page's step 3 has shown what an untrusted host key says."""
    for program in blocks("python"):
        name = "crash.py" if "out of patience" in program else "train.py"
        (folder / name).write_text(program)
    empty = folder / "known_hosts.empty"
    empty.write_text("")
    tut = Tutorial(cluster, folder, empty)
    hosts = cluster.hosts[:2]
    tut.subs = [(str(h.remote_dir), "~/orch") for h in hosts]
    tut.subs += [(str(empty), "/home/me/.ssh/known_hosts"), (sys.executable, "python3"),
                 (str(folder), "/home/me/hello")]
    tut.subs += [(h.address, a) for h, a in zip(hosts, ADDRESSES)]
    tut.subs += [(f"[{a}]:{cluster.port}", a) for a in ADDRESSES]   # as known_hosts names it
    tut.subs += [(f"-p {cluster.port} ", "-p 22 "), (f":{cluster.port})", ":22)"),
                 ("root@", "ubuntu@")]
    return tut


def rank_log(host: FakeHost, rank: int) -> str:
    """A rank's log as the host holds it (the fake hosts share this file system): read
    directly, where an `orch logs` per look cost a login and seconds of CPU that the
    starting ranks needed. `orch up` empties it before the ranks start."""
    try:
        return (host.remote_dir / "hello" / "logs" / f"rank-{rank}.log").read_text()
    except FileNotFoundError:
        return ""


def page_inventory(tut: Tutorial, known_hosts: Path) -> None:
    yamls = blocks("yaml")
    doc = yaml.safe_load(next(b for b in yamls if "hosts:" in b))
    assert [h["address"] for h in doc["hosts"]] == list(ADDRESSES)
    if (tut.folder / ".step7").exists():   # step 7's job: section replaces step 5's
        doc["job"] = yaml.safe_load(next(b for b in yamls if "args:" in b))["job"]
    tut.inventory(doc, known_hosts)


@pytest.mark.ssh
@pytest.mark.slow
def test_the_tutorial_runs_as_written(sshd_cluster: SshdCluster, tmp_path: Path,
                                      jobs: Jobs) -> None:
    folder = tmp_path / "hello"
    folder.mkdir()
    tut = prepare(sshd_cluster, folder)
    hosts = sshd_cluster.hosts[:2]
    jobs.add(folder / "cluster.yaml", hosts, "hello")
    jobs.add(folder / "crash.yaml", hosts, "crash")
    page_inventory(tut, tut.known_hosts)
    problems: list[str] = []
    dump: list[str] = []
    started = time.monotonic()
    for step in steps(PAGE.read_text()):
        if step.command == "orch up --detach":   # step 7: the job: section it shows
            (folder / ".step7").touch()
            page_inventory(tut, sshd_cluster.known_hosts)
        code, out = run(tut, step)
        printed = tut.normalise(out)
        dump += [f"$ {step.command}   (line {step.line}, exit {code})", *printed, ""]
        want = expected_code(step) if step.shown is not None else 0
        if code is not None and code != want:
            problems.append(f"line {step.line}: `{step.command}` exited {code}, not {want}:\n"
                            + "\n".join(printed[-15:]))
        elif code is None and not any(is_rank(line) for line in printed):
            problems.append(f"line {step.line}: `{step.command}` printed no rank's line in "
                            f"{FOLLOW_S:g} s:\n" + "\n".join(printed))
        elif step.shown is None and code is not None and any(
                line.startswith("orch: ") for line in printed):   # an error, or a blamed host
            problems.append(f"line {step.line}: `{step.command}` said:\n" + "\n".join(printed))
        elif step.shown is not None:
            why = matches(tut.normalise("\n".join(step.shown)), printed)
            if why:
                problems.append(f"line {step.line}: `{step.command}`: {why}\nprinted:\n"
                                + "\n".join(printed[-40:]))
        if "host key not trusted" in "\n".join(step.shown or []):
            page_inventory(tut, sshd_cluster.known_hosts)   # step 3 done: keys trusted
        if step.command == "orch up --detach":   # the reader waits for the ranks' first lines
            wait_until(lambda: "step 2: " in rank_log(hosts[1], 2), 180,
                       "rank 2's third step", step=0.2)
    if os.environ.get("TUTORIAL_DUMP"):
        Path(os.environ["TUTORIAL_DUMP"]).write_text("\n".join(dump))
    print(f"the tutorial's commands took {time.monotonic() - started:.1f} s")
    assert not problems, "docs/tutorial.md and orch disagree:\n\n" + "\n\n".join(problems)
    assert (folder / "outputs" / "hello" / "result.txt").read_text() == "world size 4, sum 6\n"
    assert_nothing_left(hosts, "hello", wait=10)
    assert_nothing_left(hosts, "crash", wait=10)


def test_the_page_has_commands_and_shown_output() -> None:
    """Without hosts: the page parses into the steps the test above runs."""
    found = steps(PAGE.read_text())
    commands = [s.command for s in found]
    assert "orch up --dry-run" in commands and "orch stop" in commands
    assert any(c.startswith("orch exec") for c in commands)
    assert any("| head" in c for c in commands)
    assert all(s.shown for s in found if s.shown is not None), "a $ line with no output shown"


def test_normalising_makes_runs_comparable() -> None:
    tut = Tutorial(SshdCluster.__new__(SshdCluster), Path("/x"), Path("/k"))
    lines = tut.normalise("started (MASTER_ADDR=10.0.0.8:41605) in 0.6 s, 12.4s\n"
                          "│ 0    │ 10.0.0.8 │ 17890 │ running │\n"
                          "┏━━━━━━┳━━━━┓\n")
    assert lines == ["started (MASTER_ADDR=10.0.0.8:PORT) in T s, Ts", "│ 0 │ 10.0.0.8 │ PID │ running │",
                     "┏━┳━┓"]
    assert matches(["[r1 h] a", "x", "...", "z"], ["x", "[r1 h] a", "y", "z"]) == ""
    assert matches(["x", "z"], ["x", "y", "z"]) != ""
    assert matches(["x", "...", "z"], ["z", "x"]) != ""
