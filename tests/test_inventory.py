"""cluster.yaml: a valid inventory's objects, and a corpus of broken ones (tests/inventories/)."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from orchestrator import yamlnodes
from orchestrator.errors import InventoryError, UsageError
from orchestrator.inventory import (Cluster, Host, RankSlot, SSHOptions, load, parse)

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
