"""cluster.yaml: an empty value (`key:` and nothing after it) is refused at its line
except where the default is "unset" (docs/reference/cluster-yaml.md), and what acts on
one distributed job only is refused with `job.array`."""
from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.inventory import load
from orchestrator.errors import InventoryError

HEAD = """\
name: demo
hosts:
  - address: localhost
    connection: local
{host}job:
  entrypoint: train.py
{job}{top}"""

# key -> (where it goes, its lines): each is refused at the key's line
EMPTY_REFUSED = {
    "job.hang_timeout": ("job", "  hang_timeout:\n"),
    "job.checkpoint": ("job", "  checkpoint:\n"),
    "job.min_hosts": ("job", "  min_hosts:\n"),
    "job.args": ("job", "  args:\n"),
    "job.env": ("job", "  env:\n"),
    "code": ("top", "code:\n"),
    "code.exclude": ("top", "code:\n  exclude:\n"),
    "data": ("top", "data:\n"),
    "ssh": ("top", "ssh:\n"),
    "setup": ("top", "setup:\n"),
    "setup.commands": ("top", "setup:\n  commands:\n"),
    "ssh.proxy_jump": ("top", "ssh:\n  proxy_jump:\n"),
    "hosts[0].proxy_jump": ("host", "    proxy_jump:\n"),
}
EMPTY_ALLOWED = {   # the default is "unset"
    "ssh.user": ("top", "ssh:\n  user:\n"),
    "ssh.port": ("top", "ssh:\n  port:\n"),
    "ssh.identity_file": ("top", "ssh:\n  identity_file:\n"),
    "data.source": ("top", "data:\n  source:\n"),
    "data.shards": ("top", "data:\n  shards:\n"),
    "job.master_port": ("job", "  master_port:\n"),
}


def inventory(tmp_path: Path, where: str, lines: str) -> Path:
    (tmp_path / "train.py").write_text("print(1)\n")
    parts = {"host": "", "job": "", "top": ""}
    parts[where] = lines
    path = tmp_path / "cluster.yaml"
    path.write_text(HEAD.format(**parts))
    return path


@pytest.mark.parametrize("key", sorted(EMPTY_REFUSED))
def test_an_empty_value_is_refused_at_its_line(tmp_path: Path, key: str) -> None:
    where, lines = EMPTY_REFUSED[key]
    path = inventory(tmp_path, where, lines)
    with pytest.raises(InventoryError) as caught:
        load(path)
    error = caught.value
    text = path.read_text().splitlines()
    assert f"`{key}` has no value" in str(error), error
    assert error.line is not None and text[error.line - 1].strip() == key.rsplit(".", 1)[-1] + ":", (error.line, text)
    assert "delete" in str(error.hint) or "give" in str(error.hint)


@pytest.mark.parametrize("key", sorted(EMPTY_ALLOWED))
def test_an_empty_value_is_the_default_where_that_is_unset(tmp_path: Path, key: str) -> None:
    load(inventory(tmp_path, *EMPTY_ALLOWED[key]))


def test_an_explicit_empty_list_still_means_none(tmp_path: Path) -> None:
    path = inventory(tmp_path, "job", "  args: []\n  env: {}\n  checkpoint: []\n")
    job = load(path).job
    assert (job.args, job.env, job.checkpoint) == ((), (), ())
    path = inventory(tmp_path, "top", "code:\n  paths: [train.py]\n  exclude: []\n")
    assert load(path).code.exclude == ()


ARRAY = "  array:\n    matrix: {fold: [0, 1]}\n"


@pytest.mark.parametrize("line", ["restarts: 2", "min_hosts: 1", "checkpoint: [output/*.pt]",
                                  "checkpoint_to: host", "hang_timeout: 60"])
def test_one_job_settings_are_refused_with_an_array(tmp_path: Path, line: str) -> None:
    path = inventory(tmp_path, "job", ARRAY + f"  {line}\n")
    with pytest.raises(InventoryError) as caught:
        load(path)
    key = line.split(":")[0]
    assert f"`job.{key}`" in str(caught.value) and "job array" in str(caught.value)
    assert caught.value.line == 9


def test_a_setup_item_read_as_a_mapping_says_to_quote_it(tmp_path: Path) -> None:
    path = inventory(tmp_path, "top", "setup:\n  - echo step: 1\n")
    with pytest.raises(InventoryError) as caught:
        load(path)
    assert "not a mapping" in str(caught.value) and 'in quotes' in caught.value.hint
    assert "key: value" not in caught.value.hint   # not the shape it refuses


def test_gpus_text_other_than_all_names_all(tmp_path: Path) -> None:
    with pytest.raises(InventoryError) as caught:
        load(inventory(tmp_path, "host", "    gpus: every\n"))
    assert "`hosts[0].gpus` must be a number of GPUs or `all`" in str(caught.value)
    assert caught.value.line == 5 and "gpus: all" in caught.value.hint
