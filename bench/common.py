"""Shared helpers for the benchmarks: timing, tables, a fake SSH cluster, and the test
bed of the fault and scale benchmarks (login users, the stand-in torchrun, pdsh, the
check that nothing is left)."""
from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the fake cluster lives beside the tests

from sshd_cluster import FakeHost, SshdCluster, free_port, loopback, pid_alive  # noqa: E402

VENV = REPO / ".venv"
VENV_PY = VENV / "bin" / "python"
ORCH = VENV / "bin" / "orch"
OUT_DIR = REPO / "bench" / "out"
STANDIN = REPO / "bench" / "torchrun_standin.py"
PLAIN_USER = "orchbench"
SYSTEM_PY = "/usr/bin/python3"


@dataclass
class Run:
    """One timed command: wall seconds, exit code, output."""
    seconds: float
    returncode: int
    stdout: str
    stderr: str
    machine: float = float("nan")   # the machine's busy CPU seconds meanwhile, where measured

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, n: int = 800) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-n:]


def timed_run(cmd: Sequence[str], *, env: dict | None = None, cwd: Path | None = None,
              timeout: float = 300) -> Run:
    """Run cmd to completion and time it; a timeout counts as a failed run."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(list(cmd), env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return Run(time.perf_counter() - t0, p.returncode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(time.perf_counter() - t0, 124, out, f"timed out after {timeout:.0f} s")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_of(fn: Callable[[], float], k: int = 3) -> tuple[float, list[float]]:
    """Median of k calls of fn (each returns seconds), and all k samples."""
    samples = [fn() for _ in range(k)]
    return median(samples), samples


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A table with rich when it is installed, aligned plain text otherwise."""
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for r in cells:
        table.add_row(*r)
    Console().print(table)


def markdown(headers: list[str], rows: list[list]) -> None:
    """A Markdown table (what the README holds), never wrapped."""
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "-" if v != v else f"{v:.2f}"
        return str(v)
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for r in rows:
        print("| " + " | ".join(cell(v) for v in r) + " |")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.2f}"
    return str(value)


def wide_address(k: int) -> str:
    """The k-th host of a wide cluster: 250 to a /24 from 127.0.1.1 (1,000 hosts are
    127.0.1.1-127.0.4.250), apart from the tests' clusters on 127.0.0.x."""
    return f"127.0.{1 + k // 250}.{1 + k % 250}"


class WideCluster(SshdCluster):
    """An SshdCluster whose hosts go past one /24 (wide_address)."""

    def add_host(self, trusted: bool = True) -> FakeHost:
        index = len(self.all_hosts())
        host = self._spawn(index, wide_address(index))
        (self.hosts if trusted else self.untrusted_hosts).append(host)
        self._write_known_hosts()
        return host


@contextmanager
def fake_cluster(n: int, root: Path | None = None, first_octet: int = 2,
                 sshd_options: dict | None = None, wide: bool = False) -> Iterator[SshdCluster]:
    """A started n-host SshdCluster under a temp dir, stopped (and checked) on exit;
    wide: on 127.0.1.1 and on (wide_address) instead of 127.0.0.<first_octet>..."""
    with tempfile.TemporaryDirectory(prefix="orch-bench-") as tmp:
        base = Path(root) if root else Path(tmp)
        # the addresses sshd binds: in a pytest-xdist worker (a test that uses this bed)
        # those are the worker's own, not 127.0.0.x (sshd_cluster.loopback)
        addresses = [wide_address(i) if wide else loopback(first_octet + i) for i in range(n)]
        kind = WideCluster if wide else SshdCluster
        cluster = kind(base / "cluster", n, port=free_port(addresses),
                       first_octet=first_octet, sshd_options=sshd_options)
        with cluster:
            yield cluster


def clean_env(**extra: str) -> dict:
    """The environment for commands under test: no user ssh config, no colour."""
    env = dict(os.environ, ORCH_SSH_CONFIG=os.devnull, ORCH_NO_COLOR="1")
    env.update(extra)
    return env


def save_json(name: str, data: object) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(data, indent=2))
    return path


def pdsh_env(cluster: SshdCluster) -> dict:
    """pdsh -R ssh with the fake cluster's ssh options on ssh's command line (port,
    identity, host keys) and no ssh config read at all (-F /dev/null): the cheapest
    ssh start there is, which is what a tuned run_dist.sh gets."""
    return clean_env(PDSH_SSH_ARGS_APPEND=" ".join(ssh_options(cluster)))


def ssh_options(cluster: SshdCluster) -> list[str]:
    """The fake cluster's client settings as ssh command-line options."""
    opts = {"Port": cluster.port, "IdentityFile": cluster.client_key, "IdentitiesOnly": "yes",
            "UserKnownHostsFile": cluster.known_hosts, "GlobalKnownHostsFile": "/dev/null",
            "StrictHostKeyChecking": "yes", "BatchMode": "yes", "LogLevel": "ERROR"}
    return ["-F", "/dev/null"] + [f"-o{k}={v}" for k, v in opts.items()]


def orch_env() -> dict:
    """An installed orch has its bytecode compiled (pip does it); where the environment
    sets PYTHONDONTWRITEBYTECODE, every command would compile orch's sources again
    (0.3-0.5 s of CPU here), which no user pays. compile_orch() compiles them once."""
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def compile_orch() -> None:
    subprocess.run([str(VENV_PY), "-m", "compileall", "-q", str(REPO / "orchestrator")],
                   check=True, env=orch_env())


# ---------------------------------------------------------------- login users

@dataclass
class Shell:
    name: str           # "root" or "plain"
    user: str
    home: Path


ROOT_SHELL = Shell("root", "root", Path("/root"))


def plain_shell(pub_key: str) -> Shell:
    """The user `orchbench` with /bin/sh, made if missing; the cluster's client key
    authorized for it (unauthorize() removes it again)."""
    try:
        pw = pwd.getpwnam(PLAIN_USER)
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", PLAIN_USER], check=True)
        pw = pwd.getpwnam(PLAIN_USER)
    unlock(PLAIN_USER)
    ssh = Path(pw.pw_dir) / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    keys = ssh / "authorized_keys"
    old = keys.read_text() if keys.exists() else ""
    keys.write_text(old + pub_key + "\n")
    for p in (ssh, keys):
        os.chown(p, pw.pw_uid, pw.pw_gid)
    keys.chmod(0o600)
    return Shell("plain", PLAIN_USER, Path(pw.pw_dir))


def unlock(user: str) -> None:
    """useradd leaves the password `!` (locked); with UsePAM no, sshd then refuses even
    keys. `*`: no password can match, but the account is not locked."""
    for line in Path("/etc/shadow").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == user and rest.startswith("!"):
            subprocess.run(["usermod", "-p", "*", user], check=True)


def unauthorize(shell: Shell, pub_key: str) -> None:
    keys = shell.home / ".ssh" / "authorized_keys"
    if keys.exists():
        keys.write_text("".join(line for line in keys.read_text().splitlines(True)
                                if line.strip() != pub_key))


def remote_base(cluster: SshdCluster, shell: Shell) -> Path:
    """Where the hosts' job folders go: beside the cluster for root, in the plain
    user's home (under a name of this run, removed at the end) for the plain user."""
    if shell.user == "root":
        return cluster.root.parent / "remote"
    return shell.home / f"orchscale-{os.getpid()}"


def prepare_remote(path: Path, shell: Shell) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if shell.user != "root":
        pw = pwd.getpwnam(shell.user)
        os.chown(path, pw.pw_uid, pw.pw_gid)


# ---------------------------------------------------------------- the stand-in torchrun

# The stand-in torch package. BENCH_TORCH_IMPORT_DELAY (scale.py --import-delay): its import
# takes that long, as latency: on a real cluster every host imports torch (seconds) on its
# own CPU and disk, all at once; here the hosts share 2 cores, so a sleep stands for it.
STANDIN_TORCH = ('"""Stand-in torch for the benchmarks."""\n'
                 "import os\nimport time\n"
                 'time.sleep(float(os.environ.get("BENCH_TORCH_IMPORT_DELAY") or 0))\n')


def make_venv(root: Path) -> Path:
    """A venv of the system python at root (no pip: 0.1 s), readable by every user (the
    plain shell's user too, who cannot reach root's own pythons); its site-packages."""
    subprocess.run([SYSTEM_PY, "-m", "venv", "--without-pip", str(root)], check=True)
    root.chmod(0o755)
    found = sorted((root / "lib").glob("python3*/site-packages"))
    return found[0]


def make_standin(root: Path) -> str:
    """A venv of the system python at <root>/venv whose site-packages holds the stand-in
    torch: torch/distributed/run.py (bench/torchrun_standin.py) and a torch dist-info with
    the real version (preflight compares versions). Its python is run straight, as a user's
    venv is: no wrapper script, no PYTHONPATH, so orch and the baseline pay exactly one
    interpreter start for each python they run. Returns that python."""
    from importlib.metadata import version
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    site = make_venv(root / "venv")
    pkg = site / "torch" / "distributed"
    pkg.mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(STANDIN_TORCH)
    (pkg / "__init__.py").write_text("")
    shutil.copy(STANDIN, pkg / "run.py")
    info = site / f"torch-{version('torch')}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version('torch')}\n")
    for p in [site / "torch", *(site / "torch").rglob("*"), info, *info.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return str(root / "venv" / "bin" / "python")


def torch_venv(root: Path) -> str:
    """The real torch for a user who cannot run this checkout's venv (its python is under
    /root): a venv of the system python at root whose site-packages reaches this venv's
    packages (a .pth line) and holds torch's dist-info (preflight's fast look). Its python."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    site = make_venv(root / "venv")
    ours = sorted((VENV / "lib").glob("python3*/site-packages"))[0]
    (site / "orch-bench-torch.pth").write_text(f"{ours}\n")
    for info in ours.glob("torch-*.dist-info"):
        (site / info.name).symlink_to(info)
    return str(root / "venv" / "bin" / "python")


# ---------------------------------------------------------------- processes

def scan_marked(needles: list[str]) -> list[int]:
    """Live pids whose environment or command line holds any needle (one /proc pass)."""
    want = [n.encode() for n in needles]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                blob = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                blob += f.read()
        except OSError:
            continue
        if any(w in blob for w in want) and pid_alive(int(name)):
            found.append(int(name))
    return found


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def prove_clean(sshds: list[int], needles: list[str]) -> bool:
    """Every sshd this run started is gone, and nothing of its jobs runs (no process
    names this run's folders or markers in its command line or environment); printed."""
    alive = [p for p in sshds if pid_alive(p)]
    left = scan_marked(needles)
    print(f"cleanup: {len(sshds)} sshd started, {len(alive)} still running; "
          f"{len(left)} processes of the benchmark left" + (f": {left}" if left else ""))
    return not alive and not left


# ---------------------------------------------------------------- the bed

@dataclass
class Bed:
    """Some hosts of a fake cluster, logged in as this user, running this python
    (the venv's, or the stand-in's wrapper)."""
    cluster: SshdCluster
    hosts: list[FakeHost]
    shell: Shell
    python: str
    work: Path                           # inventories and orch's state, on this machine
    remote: Path                         # under it: host<i>/ (orch) and pdsh/ (baseline)
    real_torch: bool = False
    dirs: list[str] = field(default_factory=list)   # job dirs of the last inventory
    ssh: dict = field(default_factory=dict)          # more of the inventory's ssh: section

    @property
    def n(self) -> int:
        return len(self.hosts)

    def inventory(self, name: str, source: str | Path, env: dict | None = None,
                  procs: int = 1) -> Path:
        """A job folder on this machine with its script, and its cluster.yaml (procs:
        ranks per host)."""
        work = self.work / name
        work.mkdir(parents=True, exist_ok=True)
        write_script(work / "job.py", source)
        entries = []
        for i, h in enumerate(self.hosts):
            d = self.remote / f"host{i}"
            prepare_remote(d, self.shell)
            entries.append({"address": h.address, "procs": procs, "remote_dir": str(d)})
        self.dirs = [f"{e['remote_dir']}/{name}" for e in entries]
        return self.cluster.write_inventory(
            work / "cluster.yaml", hosts=self.hosts, name=name, entrypoint="job.py",
            code_paths=["job.py"], env=env,
            top={"hosts": entries, "python": self.python,
                 "ssh": {"user": self.shell.user, **self.ssh}})

    def left_over(self) -> list[int]:
        """The last inventory's job processes still alive on any host."""
        return scan_marked([f"ORCH_JOB_DIR={d}\0" for d in self.dirs])

    def pdsh_dir(self, source: str | Path) -> Path:
        """The baseline's job folder (shared by the hosts, like an NFS home), filled beforehand."""
        d = self.remote / "pdsh"
        prepare_remote(d, self.shell)
        write_script(d / "job.py", source)
        return d

    def pdsh_argv(self, remote: str) -> list[str]:
        """pdsh over ssh to every host of the bed at once (-f 256, or the host count if more), as the bed's user."""
        return ["pdsh", "-R", "ssh", "-f", str(max(256, self.n)), "-l", self.shell.user,
                "-w", ",".join(h.address for h in self.hosts), remote]

    def torchrun_remote(self, d: Path, port: int, env: str = "", procs: int = 1) -> str:
        """run_dist.sh style: the node rank from the address (127.0.0.<first + rank>, or
        a wide cluster's 127.0.<1 + rank // 250>.<1 + rank % 250>); env: `K=V ...` put
        before the command; procs: ranks per host."""
        if not self.hosts[0].address.startswith("127.0.0."):
            rank = "h=%h; b=${h##*.}; a=${h%.*}; a=${a##*.}; R=$(( (a - 1) * 250 + b - 1 ))"
        else:
            first = int(self.hosts[0].address.rsplit(".", 1)[1])
            rank = f"h=%h; R=$(( ${{h##*.}} - {first} ))"
        return (f"{rank}; cd {d} && {env + ' ' if env else ''}"
                f"{self.python} -m torch.distributed.run --nnodes {self.n} --node-rank $R "
                f"--nproc-per-node {procs} --master-addr {self.hosts[0].address} "
                f"--master-port {port} job.py")


def write_script(path: Path, source: str | Path) -> None:
    if isinstance(source, Path):
        shutil.copy(source, path)
    else:
        path.write_text(source)
    path.chmod(0o644)


@dataclass
class Beds:
    """What bed_cluster() made: the cluster, the stand-in's python, the shells; clean is
    set on the way out (nothing of the run left)."""
    cluster: SshdCluster
    python: str
    shells: dict[str, Shell]
    torch_python: str = ""   # the real torch, runnable by the plain user too
    clean: bool = False


INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")


@contextmanager
def inotify_room(hosts: int) -> Iterator[None]:
    """Room for one inotify instance per fake host's follow (agent/notify.py), all run
    by one user here: a real host runs one follow, well within the default 128 per
    user; 1,000 fake hosts would spend them and their follows would poll instead. Raised
    for the run (root only) and set back after."""
    try:
        before = int(INOTIFY_INSTANCES.read_text())
        wanted = 2 * hosts + 256
        if before < wanted:
            INOTIFY_INSTANCES.write_text(str(wanted))
    except (OSError, ValueError):   # not root, or no such setting: the follows may poll
        yield
        return
    try:
        yield
    finally:
        if before < wanted:
            INOTIFY_INSTANCES.write_text(str(before))


@contextmanager
def bed_cluster(n: int, shells: Sequence[str], first_octet: int = 2,
                wide: bool = False) -> Iterator[Beds]:
    """An n-host cluster whose sshd also reads the plain user's ~/.ssh/authorized_keys,
    the stand-in torchrun, and the asked login shells ("root", "plain"). On the way out,
    interrupted too: every process naming this run's folders is killed, the plain user's
    key and folders removed, and the check that nothing is left printed (beds.clean).
    Each host's follow gets its inotify instance (inotify_room)."""
    with inotify_room(n), hosts_bed(n, shells, first_octet, wide) as beds:
        yield beds


@contextmanager
def hosts_bed(n: int, shells: Sequence[str], first_octet: int, wide: bool) -> Iterator[Beds]:
    standin = Path(tempfile.mkdtemp(prefix="orch-bench-standin-"))
    sshds: list[int] = []
    needles = [str(standin), f"orchscale-{os.getpid()}", f"orchscale{os.getpid()}x"]
    beds = None
    try:
        python = make_standin(standin)
        real = torch_venv(standin / "torch")
        options = {"AuthorizedKeysFile": "{authorized_keys} .ssh/authorized_keys"}
        with fake_cluster(n, first_octet=first_octet, sshd_options=options,
                          wide=wide) as cluster:
            sshds = [h.pid for h in cluster.hosts]
            needles.append(str(cluster.root.parent))
            pub = cluster.authorized_keys.read_text().strip()
            made = {"root": ROOT_SHELL}
            if "plain" in shells:
                made["plain"] = plain_shell(pub)
            beds = Beds(cluster, python, made, real)
            try:
                yield beds
            finally:   # the jobs' supervisors are not under any sshd
                kill_pids(scan_marked(needles))
                if "plain" in made:
                    unauthorize(made["plain"], pub)
                    shutil.rmtree(remote_base(cluster, made["plain"]), ignore_errors=True)
    finally:
        shutil.rmtree(standin, ignore_errors=True)
        clean = prove_clean(sshds, needles)
        if beds is not None:
            beds.clean = clean


# ---------------------------------------------------------------- a rank crash under pdsh

def crash_time(output: str) -> float:
    """The clock the crashing rank printed (`crash_at <time>`) just before exiting."""
    m = re.search(r"crash_at (\d+\.\d+)", output)
    if not m:
        raise SystemExit(f"no crash line in the output:\n{output[-1500:]}")
    return float(m.group(1))


def pdsh_crash(bed: Bed, source: str | Path, env: str, timeout: float) -> tuple[float, Run]:
    """The baseline of a rank crash: `source` launched run_dist.sh style (pdsh + torchrun,
    no fail-fast) with `K=V` env; seconds from the crash to pdsh returning, and the run.
    Whatever is left (a timed-out run) is killed by the marker this adds."""
    d = bed.pdsh_dir(source)
    port = free_port([bed.hosts[0].address], 29500, 29900)
    marker = f"ORCH_JOB_DIR={d}/marker"   # lets the bench find and end what it started
    remote = bed.torchrun_remote(d, port, f"{marker} {env}".strip())
    run = timed_run(bed.pdsh_argv(remote), env=pdsh_env(bed.cluster), timeout=timeout)
    ended = time.time()
    kill_pids(scan_marked([marker + "\0"]))
    return ended - crash_time(run.stdout), run
