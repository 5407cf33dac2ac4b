"""cluster.yaml: a valid inventory's objects, and a corpus of broken ones (tests/inventories/)."""
from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import pytest
import yaml

from helpers import orch_in_process
from orchestrator.config import yamlnodes
from orchestrator.config.hostspec import MAX_HOSTS, MAX_WORLD_SIZE
from orchestrator.config.inventory import (
    MAX_FILE_BYTES,
    Cluster,
    Host,
    RankSlot,
    SSHOptions,
    load,
    parse,
)
from orchestrator.config.yamlnodes import MAX_VALUE_BYTES
from orchestrator.errors import InventoryError, UsageError

CORPUS = Path(__file__).parent / "inventories"
HOME = os.path.expanduser("~")

# The SPEC's example, with three hosts holding 2, 1 and 3 ranks.
FULL = """\
name: coil3-vggf
ssh:
  user: ubuntu
  port: 22
  identity_file: ~/.ssh/id_ed25519
  known_hosts: ~/.ssh/known_hosts
  host_key_policy: strict
  connect_timeout: 10
hosts:
  - address: 10.128.0.8
    gpus: 2
  - address: 10.128.0.9
    gpus: 1
    port: 2222
    remote_dir: /scratch/orch
    python: /opt/venv/bin/python
  - address: 10.128.0.10
    procs: 3
    host_key_policy: accept-new
    connect_timeout: 2.5
remote_dir: ~/orch
python: python3
code:
  paths: [worker, train_extra.py]
  exclude: ["*.pyc", "__pycache__", ".git"]
data:
  source: data/coil3
  shards: data/coil3-shards
job:
  entrypoint: worker.train
  args: [--model, vggf, --epochs, "5", --lr, "1e-5", --batch-size, "64"]
  env: {NCCL_DEBUG: WARN, GLOO_SOCKET_IFNAME: lo}
  master_port: 29500
  max_restarts: 0
"""

MINIMAL = """\
name: demo
hosts:
  - address: localhost
    connection: local
job:
  entrypoint: worker.train
"""


def write(folder: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.fixture
def full(tmp_path: Path) -> Cluster:
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "train.py").write_text("")
    (tmp_path / "train_extra.py").write_text("")
    return load(write(tmp_path, FULL))


def test_full_inventory_hosts_and_ranks(full: Cluster, tmp_path: Path) -> None:
    assert full.path == tmp_path / "cluster.yaml"
    assert full.name == "coil3-vggf"
    assert [h.procs for h in full.hosts] == [2, 1, 3]
    assert [h.first_rank for h in full.hosts] == [0, 2, 3]
    assert full.world_size == 6
    assert full.ranks == (RankSlot(0, 0, 0), RankSlot(1, 0, 1), RankSlot(2, 1, 0),
                          RankSlot(3, 2, 0), RankSlot(4, 2, 1), RankSlot(5, 2, 2))
    assert [full.host_of(r).index for r in range(6)] == [0, 0, 1, 2, 2, 2]
    assert list(full.hosts[2].ranks) == [3, 4, 5]
    assert full.master is full.hosts[0]
    assert [h.line for h in full.hosts] == [10, 12, 17]


def test_full_inventory_overrides_and_defaults(full: Cluster) -> None:
    h0, h1, h2 = full.hosts
    assert h0 == Host(0, "10.128.0.8", "ssh", 2, 2, 0, "~/orch", "python3", h0.ssh, 10, "10.128.0.8")
    assert h0.ssh == SSHOptions("ubuntu", 22, f"{HOME}/.ssh/id_ed25519", f"{HOME}/.ssh/known_hosts",
                                "strict", 10.0)
    assert (h1.ssh.port, h1.remote_dir, h1.python, h1.ssh.user) == \
        (2222, "/scratch/orch", "/opt/venv/bin/python", "ubuntu")
    assert (h2.gpus, h2.ssh.host_key_policy, h2.ssh.connect_timeout, h2.ssh.port) == \
        (0, "accept-new", 2.5, 22)
    assert [h.label for h in full.hosts] == ["10.128.0.8", "10.128.0.9", "10.128.0.10"]


def test_full_inventory_code_data_job(full: Cluster, tmp_path: Path) -> None:
    assert full.code.paths == ("worker", "train_extra.py")
    assert full.code.exclude == ("*.pyc", "__pycache__", ".git")
    assert full.data.source == tmp_path / "data" / "coil3"
    assert full.data.shards == tmp_path / "data" / "coil3-shards"
    job = full.job
    assert job.entrypoint == "worker.train" and job.is_module
    assert job.args == ("--model", "vggf", "--epochs", "5", "--lr", "1e-5", "--batch-size", "64")
    assert job.env == (("GLOO_SOCKET_IFNAME", "lo"), ("NCCL_DEBUG", "WARN"))
    assert (job.master_port, job.max_restarts) == (29500, 0)
    assert full.base_dir == tmp_path
    assert full.state_dir == tmp_path / ".orch" / "coil3-vggf"


def test_objects_are_frozen(full: Cluster) -> None:
    for obj, field in [(full, "name"), (full.hosts[0], "procs"), (full.hosts[0].ssh, "port"),
                       (full.job, "entrypoint"), (full.code, "paths"), (full.ranks[0], "rank")]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)


def test_defaults(tmp_path: Path) -> None:
    cluster = load(write(tmp_path, MINIMAL))
    host = cluster.hosts[0]
    assert (host.connection, host.gpus, host.procs, host.remote_dir, host.python) == \
        ("local", 0, 1, "~/orch", "python3")
    assert host.ssh == SSHOptions(None, None, None, f"{HOME}/.ssh/known_hosts", "strict", 10.0)
    assert (cluster.code.paths, cluster.code.exclude) == ((), ("*.pyc", "__pycache__", ".git"))
    assert (cluster.data.source, cluster.data.shards) == (None, None)
    job = cluster.job
    assert (job.args, job.env, job.master_port, job.max_restarts) == ((), (), None, 0)
    assert cluster.world_size == 1


def test_host_of_out_of_range(tmp_path: Path) -> None:
    cluster = load(write(tmp_path, MINIMAL.replace("connection: local", "connection: local\n    procs: 2")))
    assert cluster.host_of(1) is cluster.hosts[0]
    for bad in (2, -1):
        with pytest.raises(UsageError, match="ranks 0 to 1"):
            cluster.host_of(bad)


def test_gpus_set_procs(tmp_path: Path) -> None:
    cluster = load(write(tmp_path, MINIMAL.replace("connection: local", "connection: local\n    gpus: 4")))
    assert (cluster.hosts[0].procs, cluster.world_size) == (4, 4)


def test_labels_when_addresses_are_shared(tmp_path: Path) -> None:
    text = MINIMAL.replace("hosts:\n", "hosts:\n  - {address: box, port: 22}\n"
                           "  - {address: box, port: 2222}\n  - other\n"
                           "  - {address: localhost, connection: local, remote_dir: /tmp/a}\n")
    text = text.replace("hosts:\n", "hosts:\n", 1)
    cluster = load(write(tmp_path, text))
    assert [h.label for h in cluster.hosts] == \
        ["box:22", "box:2222", "other", "localhost#3", "localhost#4"]
    assert cluster.hosts[2].address == "other"  # `- other` is short for `- address: other`


def test_args_and_env_keep_what_was_written(tmp_path: Path) -> None:
    text = MINIMAL + "  args: [--lr, 1e-5, 5, yes, 0x10, 1.50, '']\n  env: {B: 1.0, A: off, C: ''}\n"
    job = load(write(tmp_path, text)).job
    assert job.args == ("--lr", "1e-5", "5", "yes", "0x10", "1.50", "")
    assert job.env == (("A", "off"), ("B", "1.0"), ("C", ""))


def test_args_as_one_string(tmp_path: Path) -> None:
    job = load(write(tmp_path, MINIMAL + "  args: --name 'two words' --epochs 5\n")).job
    assert job.args == ("--name", "two words", "--epochs", "5")


def test_local_paths_expanded(tmp_path: Path) -> None:
    text = MINIMAL.replace("connection: local", "connection: local\n    known_hosts: keys/known")
    text = "ssh:\n  identity_file: ~/k\ndata:\n  source: /abs/src\n" + text
    cluster = load(write(tmp_path, text))
    assert cluster.hosts[0].ssh.identity_file == f"{HOME}/k"
    assert cluster.hosts[0].ssh.known_hosts == str(tmp_path / "keys" / "known")
    assert cluster.data.source == Path("/abs/src")


def test_yaml_anchors_and_merge_keys(tmp_path: Path) -> None:
    text = """\
name: demo
x-gpu-box: &box {gpus: 2, python: /venv/bin/python}
hosts:
  - <<: *box
    address: a
  - <<: *box
    address: b
    gpus: 1
  - &c
    address: c
    procs: 2
job: {entrypoint: train.py}
"""
    hosts = load(write(tmp_path, text)).hosts  # x-* keys hold anchors; explicit keys beat merged ones
    assert [(h.address, h.gpus, h.procs, h.python) for h in hosts] == \
        [("a", 2, 2, "/venv/bin/python"), ("b", 1, 1, "/venv/bin/python"), ("c", 0, 2, "python3")]


def test_script_entrypoint_inside_code_paths(tmp_path: Path) -> None:
    (tmp_path / "src" / "job").mkdir(parents=True)
    (tmp_path / "src" / "job" / "train.py").write_text("")
    text = MINIMAL.replace("worker.train", "job/train.py") + "code:\n  paths: [./src/job/]\n"
    cluster = load(write(tmp_path, text))
    assert cluster.code.paths == ("src/job",)
    assert not cluster.job.is_module


def test_parse_uses_the_given_path(tmp_path: Path) -> None:
    cluster = parse(MINIMAL, tmp_path / "sub" / "c.yaml")
    assert cluster.base_dir == tmp_path / "sub"
    with pytest.raises(InventoryError) as caught:
        parse("name: demo\nhosts: [\n", "elsewhere/c.yaml")
    assert str(caught.value).startswith("elsewhere/c.yaml:2: not valid YAML")  # the last line, not past it


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="no such file") as caught:
        load(tmp_path / "missing.yaml")
    assert caught.value.hint and caught.value.line is None
    with pytest.raises(InventoryError, match="not a regular file: it is a folder"):
        load(tmp_path)
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: demo\n# caf\xe9\n")
    with pytest.raises(InventoryError, match=r"latin1.yaml:2: the file is not UTF-8"):
        load(path)


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.yaml"))


def test_corpus_is_big_enough() -> None:
    assert len(corpus()) >= 25


@pytest.fixture(params=["libyaml", "python"])
def yaml_parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both YAML parsers orch may run on: libyaml (PyYAML's C extension, used when it is
    installed) and PyYAML's pure-Python one; they must agree on every line number."""
    if request.param == "python":
        monkeypatch.setattr(yamlnodes, "_Loader", yaml.SafeLoader)
    else:   # never the pure-Python parser under libyaml's name
        assert yaml.__with_libyaml__ and hasattr(yaml, "CSafeLoader"), "PyYAML without libyaml"
        assert yamlnodes._Loader is yaml.CSafeLoader, yamlnodes._Loader
    return request.param


@pytest.mark.parametrize("path", corpus(), ids=lambda p: p.stem)
def test_broken_inventory(path: Path, yaml_parser: str) -> None:
    expect = re.fullmatch(r"# expect: (\d+) (.+)", path.read_text().splitlines()[0])
    assert expect, f"{path.name}: first line must be '# expect: <line> <substring>'"
    line, substring = int(expect[1]), expect[2].strip()
    with pytest.raises(InventoryError) as caught:
        load(path)
    error = caught.value
    message = str(error)
    assert message.startswith(f"{path}:{line}: "), message
    assert substring in message
    assert error.line == line and error.hint, message
    assert error.exit_code == 2
    assert "Traceback" not in message and len(message.splitlines()) == 2


# ---- reading is bounded: special files, size, bombs, limits ------------------------------

def refused(text: str, tmp_path: Path, seconds: float = 1.0) -> InventoryError:
    """The InventoryError that `text` gives, checked to come fast, with a line and a fix."""
    path = write(tmp_path, text)
    started = time.process_time()   # CPU seconds: the loader's cost, not the machine's load
    with pytest.raises(InventoryError) as caught:
        load(path)
    elapsed = time.process_time() - started
    assert elapsed < seconds, f"{elapsed:.2f}s: {caught.value}"
    error = caught.value
    assert error.exit_code == 2 and error.hint and error.line, str(error)
    assert str(error).startswith(f"{path}:{error.line}: ")
    assert 1 <= error.line <= len(text.splitlines()), str(error)
    return error


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder"])
def test_special_files_are_refused_without_blocking(kind: str, tmp_path: Path) -> None:
    path = {"fifo": tmp_path / "cluster.yaml", "dev_zero": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # no writer: opening it for reading the usual way would block forever
    started = time.perf_counter()
    with pytest.raises(InventoryError, match="not a regular file: it is ") as caught:
        load(path)
    assert time.perf_counter() - started < 1
    assert str(caught.value).startswith(f"{path}: ") and caught.value.hint
    assert {"fifo": "a named pipe", "dev_zero": "a device", "folder": "a folder"}[kind] in str(caught.value)


@pytest.mark.parametrize("inventory, expect", [
    ("fifo", "cluster.yaml: not a regular file: it is a named pipe"),
    ("/dev/zero", "/dev/zero: not a regular file: it is a device"),
    (str(CORPUS / "merge_bomb.yaml"), "merge_bomb.yaml:13: merge keys (`<<`) copy more than"),
    (str(CORPUS / "nesting_too_deep.yaml"), "nesting_too_deep.yaml:3: lists and mappings are nested"),
    (str(CORPUS / "args_nul.yaml"), "args_nul.yaml:8: `job.args[1]` contains a NUL character"),
])
def test_command_line_exits_2(inventory: str, expect: str, tmp_path: Path) -> None:
    if inventory == "fifo":
        os.mkfifo(tmp_path / "cluster.yaml")
    result = orch_in_process(tmp_path, "status", "-c", inventory.replace("fifo", "cluster.yaml"))
    assert result.returncode == 2, result.stderr
    assert expect in result.stderr and "fix: " in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_size_cap_is_checked_before_reading(tmp_path: Path) -> None:
    padding = "#" * 99 + "\n"
    at_cap = MINIMAL + padding * ((MAX_FILE_BYTES - len(MINIMAL)) // 100)
    at_cap += "#" * (MAX_FILE_BYTES - len(at_cap) - 1) + "\n"
    assert len(at_cap) == MAX_FILE_BYTES
    assert load(write(tmp_path, at_cap)).name == "demo"  # exactly at the cap: read
    with pytest.raises(InventoryError, match=f"larger than {MAX_FILE_BYTES} bytes") as caught:
        load(write(tmp_path, at_cap + "#"))
    assert caught.value.line is None and "ranges" in caught.value.hint
    sparse = tmp_path / "sparse.yaml"  # 1 TB on paper: refused from its size, never read
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    started = time.perf_counter()
    with pytest.raises(InventoryError, match="larger than"):
        load(sparse)
    assert time.perf_counter() - started < 1


def laughs(levels: int, fan: int, use: str) -> str:
    """A billion-laughs document: each anchor stands for `fan` copies of the one before."""
    lines = ["name: demo", "x-0: &a0 {gpus: 1}"]
    for i in range(1, levels + 1):
        items = ", ".join([f"*a{i - 1}"] * fan)
        lines.append(f"x-{i}: &a{i} {{<<: [{items}]}}" if use == "merge" else f"x-{i}: &a{i} [{items}]")
    host = "  - <<: *a{0}\n    address: localhost" if use == "merge" else "  - localhost"
    args = "" if use == "merge" else "  args: *a{0}\n"
    return "\n".join(lines) + "\nhosts:\n" + (host + "\njob:\n  entrypoint: w\n" + args).format(levels)


@pytest.mark.parametrize("use, levels, fan, expect", [
    ("merge", 9, 10, "copy more than 100000 keys"),       # 10**9 keys merged, without the budget
    ("merge", 40, 2, "nested more than 16 deep"),
    ("alias", 9, 10, "`job.args[0]` must be a single value, not a list"),  # never expanded
])
def test_billion_laughs(use: str, levels: int, fan: int, expect: str, tmp_path: Path, yaml_parser: str) -> None:
    error = refused(laughs(levels, fan, use), tmp_path)
    assert expect in str(error)


@pytest.mark.parametrize("text, line, expect", [
    ("name: demo\nhosts: &h\n  - &e {address: a, <<: *e}\njob: {entrypoint: w}\n", 3, "recursive merge key"),
    ("name: demo\nx-m: &m {a: {<<: *m}}\nhosts: [{<<: *m, address: b}]\njob: {entrypoint: w}\n", 2,
     "unknown key `hosts[0].a`"),  # *m holds a `<<: *m` deeper down: not merged, so no loop
    ("name: demo\nx: " + "[" * 5000 + "]" * 5000 + "\n", 2, "nested more than 64 deep"),
    ("name: demo\nx:\n" + "".join(" " * i + "- \n" for i in range(1, 300)), 66, "nested more than 64 deep"),
    ("name: demo\nx: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", 2, "nested more than 64 deep"),
    ("name: demo\nx-a: &a 1\nx: [" + ", ".join(["*a"] * 10_001) + "]\n", 3, "more than 10000 aliases"),
    ("name: demo\nx: [" + ", ".join(["1"] * 100_001) + "]\n", 2, "more than 100000 keys and values"),
])
def test_yaml_limits(text: str, line: int, expect: str, tmp_path: Path, yaml_parser: str) -> None:
    # PyYAML's own parser reads ~10 times slower than libyaml: 100,000 values is a size, not a bomb
    error = refused(text, tmp_path, seconds=1.0 if yaml_parser == "libyaml" or "100000" not in expect else 8.0)
    assert expect in str(error) and error.line == line, str(error)


@pytest.mark.parametrize("count", [4097, 20_000])
def test_too_many_hosts(count: int, tmp_path: Path) -> None:
    text = "name: demo\nhosts:\n" + "".join(f"  - node{i}\n" for i in range(count)) + "job: {entrypoint: w}\n"
    error = refused(text, tmp_path, seconds=2)
    assert "more than 4096 hosts (the limit)" in str(error) and error.line == 4099


def test_the_host_limit_itself_loads_fast(tmp_path: Path) -> None:
    text = "name: demo\nhosts:\n" + "".join(f"  - node{i}\n" for i in range(MAX_HOSTS)) + "job: {entrypoint: w}\n"
    path = write(tmp_path, text)
    started = time.process_time()
    cluster = load(path)
    assert time.process_time() - started < 2
    assert len(cluster.hosts) == cluster.world_size == MAX_HOSTS
    assert cluster.hosts[-1].first_rank == MAX_HOSTS - 1


@pytest.mark.parametrize("field, value, expect", [
    ("procs", 10**9, "`hosts[0].procs` must be a whole number from 1 to 1024"),
    ("gpus", 10**9, "`hosts[0].gpus` must be a whole number from 0 to 1024"),
    ("procs", 1025, "from 1 to 1024, got 1025"),
])
def test_procs_limit(field: str, value: int, expect: str, tmp_path: Path) -> None:
    text = MINIMAL.replace("connection: local", f"connection: local\n    {field}: {value}")
    error = refused(text, tmp_path)
    assert expect in str(error) and error.line == 5


def test_procs_at_the_limit(tmp_path: Path) -> None:
    text = MINIMAL.replace("connection: local", "connection: local\n    gpus: 1024")
    assert load(write(tmp_path, text)).world_size == 1024


def test_world_size_limit(tmp_path: Path) -> None:
    fits = "name: demo\nhosts:\n  - {address: 'n[01-64]', procs: 1024}\njob: {entrypoint: w}\n"
    assert load(write(tmp_path, fits)).world_size == MAX_WORLD_SIZE
    error = refused(fits.replace("job:", "  - extra\njob:"), tmp_path)
    assert "`hosts[1]` brings the job past 65536 ranks" in str(error) and error.line == 4


# ---- addresses: ASCII names and IPs; host ranges -----------------------------------------

@pytest.mark.parametrize("address, expect", [
    ("１０.0.0.8", "U+FF11 (FULLWIDTH DIGIT ONE)"),
    ("ｌｏｃａｌｈｏｓｔ", "U+FF4C (FULLWIDTH LATIN SMALL LETTER L)"),
    ('"node\\u200b1"', "U+200B (ZERO WIDTH SPACE)"),
    ('"node1\\ufeff"', "U+FEFF (ZERO WIDTH NO-BREAK SPACE)"),
    ("nоde1", "U+043E (CYRILLIC SMALL LETTER O)"),
    ('"node\\u00a01"', "U+00A0 (NO-BREAK SPACE)"),
    ("10.0.0.256", "is not a valid IP address"),
    ("'1234'", "is not a valid IP address"),
    ("fe80::zz", "is not a valid IP address"),
    ("node/1", "'/' cannot be in a host name"),
    ("'node;rm'", "';' cannot be in a host name"),
    (".node", "it starts with '.'"),
    ("a" * 254, "at most 253 characters"),
])
def test_addresses_must_be_ascii_names_or_ips(address: str, expect: str, tmp_path: Path) -> None:
    error = refused(f"name: demo\nhosts:\n  - address: {address}\njob: {{entrypoint: w}}\n", tmp_path)
    assert expect in str(error) and error.line == 3


def test_good_addresses(tmp_path: Path) -> None:
    good = ["10.0.0.8", "fe80::1", "fe80::1%eth0", "node-1.cluster.example.com", "gpu_box", "my.alias.",
            "a" * 253]
    text = "name: demo\nhosts:\n" + "".join(f"  - '{a}'\n" for a in good) + "job: {entrypoint: w}\n"
    assert [h.address for h in load(write(tmp_path, text)).hosts] == good


def test_ranges_expand_in_order(tmp_path: Path) -> None:
    text = """\
name: demo
hosts:
  - gpu[01-03]
  - address: 10.0.[0-1].[8-9]
    gpus: 2
    port: 2222
  - node[9-11,20-30/5]
  - solo
job: {entrypoint: w}
"""
    cluster = load(write(tmp_path, text))
    assert [h.address for h in cluster.hosts] == [
        "gpu01", "gpu02", "gpu03", "10.0.0.8", "10.0.0.9", "10.0.1.8", "10.0.1.9",
        "node9", "node10", "node11", "node20", "node25", "node30", "solo"]
    assert [h.index for h in cluster.hosts] == list(range(14))
    assert [h.line for h in cluster.hosts] == [3] * 3 + [4] * 4 + [7] * 6 + [8]
    ip_hosts = cluster.hosts[3:7]
    assert {(h.gpus, h.procs, h.ssh.port) for h in ip_hosts} == {(2, 2, 2222)}  # fields apply to each
    assert [h.first_rank for h in cluster.hosts] == [0, 1, 2, 3, 5, 7, 9, 11, 12, 13, 14, 15, 16, 17]
    assert cluster.world_size == 18 and cluster.host_of(7).address == "10.0.1.8"
    assert cluster.hosts[0].label == "gpu01"


@pytest.mark.parametrize("address, expect", [
    ("gpu[16-01]", "goes backwards (16-01)"),
    ("gpu[01-16", "is not a host range"),
    ("gpu01-16]", "is not a host range"),
    ("gpu[a-b]", "is not a host range"),
    ("gpu[1-4]!gpu2", "is not a host range"),   # NodeSet's set operators are not offered
    ("'gpu[1-2],cpu[1-2]'", "is not a host range"),
    ("'@gpus'", "'@gpus' contains a user name"),
    ("gpu[1--4]", "is not `a`, `a-b` or `a-b/step`"),
    ("gpu[]", "is not `a`, `a-b` or `a-b/step`"),
    ("gpu[1-016]", "padding length mismatch"),
    ("gpu[1-2][3-4]", "is not valid"),
    ("gpu[1-4/0]", "a step of 0"),
    ("gpu[1-5000]", "expands to 5000 hosts"),
    ("gpu[1-100][1-100]", "expands to 10000 hosts"),
    ("gpu[1-99999999999999999999]", "is not `a`, `a-b` or `a-b/step`"),  # digits are capped too
    ("10.0.0.[250-260]", "'10.0.0.256' is not a valid IP address"),
    ("'[::1]'", "an IPv6 address is written without brackets"),
    ("'n[1-2]:22'", "'n1:22' contains a port"),
    ("ｇpu[1-2]", "U+FF47"),
])
def test_bad_ranges(address: str, expect: str, tmp_path: Path) -> None:
    error = refused(f"name: demo\nhosts:\n  - x0\n  - address: {address}\njob: {{entrypoint: w}}\n", tmp_path)
    assert expect in str(error) and error.line == 4, str(error)


def test_range_limit_counts_earlier_hosts(tmp_path: Path) -> None:
    text = "name: demo\nhosts:\n  - a[1-4000]\n  - b[1-96]\n  - c1\njob: {entrypoint: w}\n"
    error = refused(text, tmp_path)
    assert "`hosts[2]` is past the limit of 4096 hosts" in str(error) and error.line == 5
    error = refused(text.replace("b[1-96]", "b[1-97]"), tmp_path)
    assert "expands to 97 hosts, more than the 96" in str(error) and error.line == 4


def test_range_duplicates_name_the_host(tmp_path: Path) -> None:
    text = "name: demo\nhosts:\n  - n[1-3]\n  - n[3-4]\njob: {entrypoint: w}\n"
    error = refused(text, tmp_path)
    assert "`hosts[1] (n3)` is the same host as hosts[0] (n3) (line 3)" in str(error) and error.line == 4


# ---- values that reach a host: no control characters, bounded sizes ------------------------

FIELDS = {  # field -> (text with {v} for the value, line of the value)
    "name": ("name: {v}\n" + MINIMAL[11:], 1),
    "address": (MINIMAL.replace("address: localhost", "address: {v}"), 3),
    "user": ("ssh:\n  user: {v}\n" + MINIMAL, 2),
    "identity_file": ("ssh:\n  identity_file: {v}\n" + MINIMAL, 2),
    "known_hosts": (MINIMAL.replace("connection: local", "connection: local\n    known_hosts: {v}"), 5),
    "remote_dir": (MINIMAL.replace("connection: local", "connection: local\n    remote_dir: {v}"), 5),
    "python": ("python: {v}\n" + MINIMAL, 1),
    "entrypoint": (MINIMAL.replace("entrypoint: worker.train", "entrypoint: {v}"), 6),
    "args item": (MINIMAL + "  args: [--x, {v}]\n", 7),
    "args string": (MINIMAL + "  args: {v}\n", 7),
    "env value": (MINIMAL + "  env:\n    A: {v}\n", 8),
    "code path": (MINIMAL + "code:\n  paths: [{v}]\n", 8),
    "code exclude": (MINIMAL + "code:\n  exclude: [{v}]\n", 8),
    "data source": (MINIMAL + "data:\n  source: {v}\n", 8),
    "data shards": (MINIMAL + "data:\n  shards: {v}\n", 8),
}
BAD_VALUES = {  # as written in YAML -> what the message says
    '"a\\0b"': "contains a NUL character",
    '"a\\nb"': "contains a line break",
    '"a\\rb"': "contains a carriage return",
    '"a\\eb"': "contains the control character U+001B",
    '"a\\x85b"': "contains the control character U+0085",
    '"a\\ud800b"': "U+D800",  # (libyaml refuses it as YAML: see the test)
    "x" * 70_000: "is 70000 bytes long; at most 65536 bytes",
}


VERBATIM = ("args item", "args string", "env value")   # values a program gets as they are
VERBATIM_OK = ('"a\\nb"', '"a\\rb"', '"a\\eb"', '"a\\x85b"')
VALUE_IDS = dict(zip(BAD_VALUES, ["nul", "newline", "cr", "escape", "nel", "surrogate", "70kB"]))


@pytest.mark.parametrize("field, value", [
    pytest.param(f, v, id=f"{f}-{VALUE_IDS[v]}") for f in FIELDS for v in BAD_VALUES
    if not (f in VERBATIM and v in VERBATIM_OK)])   # those: test_args_and_env_hold_any_character_but_nul
def test_control_characters_and_sizes_refused_everywhere(field: str, value: str, tmp_path: Path) -> None:
    text, line = FIELDS[field]
    error = refused(text.replace("{v}", value), tmp_path)
    assert error.line == line, str(error)
    expect = BAD_VALUES[value]
    if "ud800" in value and "not valid YAML" in str(error):
        expect = "invalid Unicode character escape"  # libyaml refuses it as it reads the file
    elif field == "address" and "0000" not in value:
        expect = "`hosts[0].address`"  # refused before: not ASCII, or not a host name
    assert expect in str(error), str(error)
    assert len(str(error)) < 500  # the value is cut in the message


@pytest.mark.parametrize("value, expect", [
    ('"one\\ntwo"', "one\ntwo"), ('"a\\rb"', "a\rb"), ('"\\e[31mred"', "\x1b[31mred"),
    ('"a\\x85b"', "a\x85b"), ('"tab\\there"', "tab\there"),
    ('"-----BEGIN KEY-----\\nAAAA\\n-----END KEY-----\\n"',
     "-----BEGIN KEY-----\nAAAA\n-----END KEY-----\n")])
def test_args_and_env_hold_any_character_but_nul(value: str, expect: str, tmp_path: Path) -> None:
    """A PEM key or a multi-line prompt in the environment is ordinary: args items and
    env values are taken byte for byte (only NUL, which no argv or environment can
    hold, and lone surrogates are refused)."""
    job = load(write(tmp_path, MINIMAL + f"  args: [--x, {value}]\n  env:\n    A: {value}\n")).job
    assert job.args == ("--x", expect) and job.env == (("A", expect),)


def test_a_block_scalar_of_args_is_split_like_a_shell_line(tmp_path: Path) -> None:
    job = load(write(tmp_path, MINIMAL + "  args: |\n    --epochs 5\n    --lr 1\n")).job
    assert job.args == ("--epochs", "5", "--lr", "1")


def test_tab_and_long_values_up_to_the_cap_pass(tmp_path: Path) -> None:
    long = "y" * MAX_VALUE_BYTES
    job = load(write(tmp_path, MINIMAL + f'  args: ["a\\tb", {long}]\n  env: {{A: {long}}}\n')).job
    assert job.args == ("a\tb", long) and job.env == (("A", long),)


def test_args_and_env_have_a_total_cap(tmp_path: Path) -> None:
    value = "v" * 60_000  # 60 kB is fine once; an alias can repeat it without growing the file
    text = f"x-big: &big {value}\n" + MINIMAL + "  args: [" + ", ".join(["*big"] * 4) + "]\n  env:\n"
    assert len(load(write(tmp_path, text + "    A: x\n")).job.args) == 4
    error = refused(text + "    A: *big\n    B: *big\n", tmp_path)
    assert "`job.args` and `job.env` hold more than 262144 bytes" in str(error) and error.line == 10
    error = refused(text.replace("*big]", "*big, *big]").replace("  env:\n", ""), tmp_path)
    assert error.line == 8 and "262144" in str(error)  # the `args:` line: its items are aliases


@pytest.mark.parametrize("text, line", [
    ("name: demo\nhosts: [\n", 2),
    ("name: demo\nhosts: [a\n\n\n", 2),
    ("name: demo\nhosts: [a\n# a comment\n  # another\n\n", 2),
    ("name: demo\nhosts: [a", 2),
    ("name: demo\njob: {entrypoint: 'w\n", 2),
    ("# \u2028 \u2029 \x85 are line breaks for YAML, not for editors\nname: [\n", 2),
])
def test_yaml_errors_at_the_end_name_the_last_line(text: str, line: int, tmp_path: Path) -> None:
    error = refused(text, tmp_path)
    assert "not valid YAML" in str(error) and error.line == line, str(error)


def test_unicode_line_breaks_do_not_shift_lines(tmp_path: Path) -> None:
    text = "# \u2028 \u2029 \x85\n" + MINIMAL.replace("connection: local", "connection: locl")
    error = refused(text, tmp_path)
    assert "`hosts[0].connection`" in str(error) and error.line == 5
