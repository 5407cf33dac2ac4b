"""orch split-data: record and ImageFolder splits, links, manifest, idempotence, bad input."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.commands import split_data
from orchestrator.errors import DataError, OrchError, UsageError
from orchestrator.files import splitdata


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs folder where there is one: these tests are thousands of tiny creates and links,
    which a busy disk makes 10-30x slower. Falls back to pytest's own tmp_path."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="orch-test-split-", dir=shm) as fast:
        yield Path(fast)


def make_records(root: Path, prefix: str, count: int, total: int | None = None) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    names = [f"{prefix}-{i:05d}-of-{total or count:05d}" for i in range(count)]
    for name in names:
        (root / name).write_bytes(b"r" * 3)
    return names


def make_imagefolder(root: Path, sizes: dict[str, int]) -> None:
    """sizes: 'TrainData/cat' -> number of files; file i holds i+1 bytes."""
    for cls, n in sizes.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (root / cls / f"img{i:03d}.png").write_bytes(b"x" * (i + 1))


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def listing(root: Path) -> list[tuple]:
    """Everything under root, with link targets and file contents: what 'unchanged' means."""
    if not os.path.lexists(root):
        return []
    if not root.is_dir():
        return [("file", root.read_bytes())]
    rows: list[tuple[str | bytes, ...]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath, name)
            if path.is_symlink():
                rows.append((str(path), "link", os.readlink(path)))
            elif path.is_file():
                rows.append((str(path), "file", path.read_bytes()))
            else:
                rows.append((str(path), "dir"))
    return sorted(rows)


def shard_files(out: Path, name: str) -> list[str]:
    base = out / name
    return sorted(str(Path(d, f).relative_to(base)) for d, _, fs in os.walk(base) for f in fs)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="orch")
    subparsers = parser.add_subparsers()
    split_data.add_parser(subparsers)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- records


def test_terngrad_records_contiguous(tmp_path: Path) -> None:
    src, out = tmp_path / "imagenet", tmp_path / "shards"
    names = make_records(src, "train", 1024)
    result = splitdata.split(src, out, 16)
    assert result.plan.kind == "records"
    assert shard_files(out, "worker_1_of_16") == [f"train-{i:05d}-of-01024" for i in range(64, 128)]
    assert shard_files(out, "worker_1_of_16")[0] == "train-00064-of-01024"
    assert shard_files(out, "worker_1_of_16")[-1] == "train-00127-of-01024"
    got = [f for i in range(16) for f in shard_files(out, f"worker_{i}_of_16")]
    assert got == names  # contiguous, in order, every file once
    shard = manifest(out)["splits"]["16"]["shards"][1]
    assert shard["classes"] == {"train-*-of-01024": 64} and shard["bytes"] == 64 * 3


def test_records_uneven_and_groups_via_command(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_records(src, "train", 10)
    make_records(src, "validation", 5)
    (src / "README.txt").write_text("not a shard")
    args = parse(["split-data", "--workers", "4", "--source", str(src), "--out", str(out)])
    assert args.func(args) == 0
    shards = manifest(out)["splits"]["4"]["shards"]
    assert [s["classes"]["train-*-of-00010"] for s in shards] == [3, 3, 2, 2]
    assert [s["classes"]["validation-*-of-00005"] for s in shards] == [2, 1, 1, 1]
    assert shard_files(out, "worker_1_of_4") == [
        "train-00003-of-00010", "train-00004-of-00010", "train-00005-of-00010",
        "validation-00002-of-00005"]
    printed = capsys.readouterr().out
    assert "uneven split of train-*-of-00010" in printed and "workers 0-1 get 3" in printed
    assert "README.txt" in printed  # the ignored file is named
    assert not os.path.lexists(out / "worker_0_of_4" / "README.txt")


def test_records_missing_shard_is_noted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_records(src, "train", 6, total=8)
    result = splitdata.split(src, tmp_path / "out", 2)
    assert any("6 files present, the names say 8" in n for n in result.plan.notes)


# ---------------------------------------------------------------- imagefolder


VGGF = {"TrainData/cat": 10, "TrainData/dog": 7, "TrainData/owl": 5,
        "ValidationData/cat": 4, "ValidationData/dog": 3, "ValidationData/owl": 3}


def test_imagefolder_balance_train_and_validation(tmp_path: Path) -> None:
    src, out = tmp_path / "coil", tmp_path / "out"
    make_imagefolder(src, VGGF)
    splitdata.split(src, out, 3)
    split = manifest(out)["splits"]["3"]
    assert split["kind"] == "imagefolder" and split["seed"] == 0
    for cls, total in VGGF.items():
        counts = [s["classes"][cls] for s in split["shards"]]
        assert sum(counts) == total and max(counts) - min(counts) <= 1
    every = sorted(f for i in range(3) for f in shard_files(out, f"worker_{i}_of_3"))
    assert every == sorted(f"{cls}/img{i:03d}.png" for cls, n in VGGF.items() for i in range(n))
    for shard in split["shards"]:
        assert shard_files(out, shard["name"]) == [f for f, _ in shard["files"]]
        assert shard["bytes"] == sum(b for _, b in shard["files"])
        assert any(f.startswith("ValidationData/") for f, _ in shard["files"])
    totals = [len(s["files"]) for s in split["shards"]]
    assert max(totals) - min(totals) <= 1  # the extras rotate across workers


def test_plain_imagefolder_and_nested_files(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, {"cat": 4, "dog": 4, "dog/puppies": 2})
    splitdata.split(src, out, 2)
    split = manifest(out)["splits"]["2"]
    assert set(split["shards"][0]["classes"]) == {"cat", "dog"}
    assert sum(s["classes"]["dog"] for s in split["shards"]) == 6
    files = [f for s in split["shards"] for f, _ in s["files"]]
    assert sum(f.startswith("dog/puppies/") for f in files) == 2


def test_deterministic_seed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_imagefolder(src, {"TrainData/cat": 40, "TrainData/dog": 40})
    splitdata.split(src, tmp_path / "a", 4, seed=0)
    splitdata.split(src, tmp_path / "b", 4, seed=0)
    splitdata.split(src, tmp_path / "c", 4, seed=1)
    a, b, c = (manifest(tmp_path / d)["splits"]["4"] for d in "abc")
    assert a == b
    assert [s["files"] for s in a["shards"]] != [s["files"] for s in c["shards"]]
    assert [s["classes"] for s in a["shards"]] == [s["classes"] for s in c["shards"]]


class _ReversedScandir:
    """os.scandir listing in reverse: another filesystem, or another copy, lists in another
    order."""

    def __init__(self, path: str) -> None:
        with _real_scandir(path) as it:
            self.entries = list(it)[::-1]

    def __enter__(self) -> list:
        return self.entries

    def __exit__(self, *exc: object) -> None:
        return None


_real_scandir = os.scandir


def test_same_split_whatever_the_listing_order(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    make_imagefolder(src, {"TrainData/cat": 30, "TrainData/dog": 30})
    splitdata.split(src, tmp_path / "a", 4)
    monkeypatch.setattr(os, "scandir", _ReversedScandir)  # splitdata calls os.scandir
    splitdata.split(src, tmp_path / "b", 4)
    assert manifest(tmp_path / "a")["splits"] == manifest(tmp_path / "b")["splits"]


def test_digest_is_sha256_of_sorted_lines(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, {"cat": 5, "dog": 3})
    splitdata.split(src, out, 2)
    for shard in manifest(out)["splits"]["2"]["shards"]:
        lines = sorted(f"{rel}\t{size}\n" for rel, size in shard["files"])
        assert shard["digest"] == hashlib.sha256("".join(lines).encode()).hexdigest()


def test_links_not_copies(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, VGGF)
    splitdata.split(src, out, 2)
    real_src = os.path.realpath(src)
    for name in ("worker_0_of_2", "worker_1_of_2"):
        for rel in shard_files(out, name):
            path = out / name / rel
            target = os.readlink(path)
            assert os.path.islink(path) and os.path.isabs(target)
            assert target == os.path.join(real_src, rel)  # original name and layout
            assert path.read_bytes() == (src / rel).read_bytes()


def test_other_n_beside_and_rerun_replaces(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, VGGF)
    first = splitdata.split(src, out, 2)
    splitdata.split(src, out, 3)
    assert sorted(manifest(out)["splits"]) == ["2", "3"]
    assert all((out / f"worker_{i}_of_2").is_dir() for i in range(2))
    before = manifest(out)
    (out / "worker_0_of_2" / "stale-extra").write_text("left from an old run")
    again = splitdata.split(src, out, 2)
    assert not first.replaced and again.replaced
    assert manifest(out) == before
    assert not os.path.lexists(out / "worker_0_of_2" / "stale-extra")
    assert sorted(p.name for p in out.iterdir()) == [
        ".orch-split.lock", "manifest.json", "worker_0_of_2", "worker_0_of_3", "worker_1_of_2",
        "worker_1_of_3", "worker_2_of_3"]  # no temp folders left


def test_symlink_inside_source_is_fine(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, {"cat": 2, "dog": 2})
    os.symlink(src / "cat" / "img000.png", src / "dog" / "alias.png")
    splitdata.split(src, out, 2)
    assert sum(s["classes"]["dog"] for s in manifest(out)["splits"]["2"]["shards"]) == 3


def test_a_mutual_symlink_loop_is_named_with_both_links(tmp_path: Path) -> None:
    """a/l1 -> ../b and b/l2 -> ../a: the loop and both links are named (it was "cannot
    read ...: check the permissions of the source" once the path grew too long); a link
    to its own parent is named alone."""
    src = tmp_path / "src"
    make_imagefolder(src, {"cat": 2, "a": 2, "b": 2})
    os.symlink("../b", src / "a" / "l1")
    os.symlink("../a", src / "b" / "l2")
    with pytest.raises(DataError) as err:
        splitdata.split(src, tmp_path / "out", 2)
    msg = err.value.message
    assert "a symlink loop of 2 links" in msg, msg
    assert f"{src}/a/l1 -> ../b" in msg and "l2 -> ../a" in msg, msg
    assert "permissions" not in err.value.hint
    os.unlink(src / "b" / "l2")
    os.unlink(src / "a" / "l1")
    os.symlink("..", src / "a" / "up")
    with pytest.raises(DataError) as err:
        splitdata.split(src, tmp_path / "out", 2)
    assert "a symlink to one of its own parent folders" in err.value.message
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- bad input


def _bad_cases(tmp: Path) -> dict[str, tuple[Path, Path, int]]:
    """name -> (source, out, workers); each must raise DataError and change nothing."""
    good, out = tmp / "good", tmp / "out"
    make_imagefolder(good, {"TrainData/cat": 4, "TrainData/dog": 3, "ValidationData/cat": 2})
    empty = tmp / "empty"
    make_imagefolder(empty, {"cat": 3})
    (empty / "dog").mkdir()
    recs = tmp / "recs"
    make_records(recs, "train", 4)
    outside = tmp / "outside"
    make_imagefolder(outside, {"x": 1})
    linked = tmp / "linked"
    make_imagefolder(linked, {"cat": 3})
    os.symlink(outside / "x" / "img000.png", linked / "cat" / "escape.png")
    afile = tmp / "afile"
    afile.write_text("I am a file")
    return {
        "missing source": (tmp / "nope", out, 2),
        "empty class": (empty, out, 2),
        "zero workers": (good, out, 0),
        "more workers than files in a class": (good, out, 3),
        "more workers than shards": (recs, out, 5),
        "symlink outside": (linked, out, 2),
        "out is a file": (good, afile, 2),
        "out inside source": (good, good / "shards", 2),
        "source inside out": (good, tmp, 2),
    }


@pytest.mark.parametrize("case", ["missing source", "empty class", "zero workers",
                                  "more workers than files in a class", "more workers than shards",
                                  "symlink outside", "out is a file", "out inside source",
                                  "source inside out"])
def test_bad_input_changes_nothing(tmp_path: Path, case: str) -> None:
    source, out, workers = _bad_cases(tmp_path)[case]
    splitdata.split(tmp_path / "good", tmp_path / "out", 2)  # an existing split that must survive
    before_out, before_tmp = listing(out), listing(tmp_path)
    with pytest.raises(DataError) as err:
        splitdata.split(source, out, workers)
    assert err.value.exit_code == 2 and err.value.hint
    assert listing(out) == before_out and listing(tmp_path) == before_tmp


def test_bad_input_messages(tmp_path: Path) -> None:
    cases = _bad_cases(tmp_path)
    expect = {"empty class": "empty class in the source: dog",
              "more workers than files in a class":
                  "ValidationData/cat has 2 file(s), fewer than the 3",
              "symlink outside": "pointing outside the source",
              "out inside source": "is inside the source"}
    for case, words in expect.items():
        source, out, workers = cases[case]
        with pytest.raises(DataError) as err:
            splitdata.split(source, out, workers)
        assert words in err.value.message, (case, err.value.message)


def test_damaged_manifest_is_refused(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, {"cat": 2})
    out.mkdir()
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(DataError):
        splitdata.split(src, out, 2)
    assert sorted(os.listdir(out)) == ["manifest.json"]


# ---------------------------------------------------------------- command glue


def fake_inventory(monkeypatch: pytest.MonkeyPatch, world_size: int, source: Path | None,
                   shards: Path | None) -> list[Path]:
    calls: list[Path] = []

    def load(path: Path) -> types.SimpleNamespace:
        calls.append(Path(path))
        return types.SimpleNamespace(world_size=world_size,
                                     data=types.SimpleNamespace(source=source, shards=shards),
                                     job=types.SimpleNamespace(array=None))

    module = types.ModuleType("orchestrator.config.inventory")
    module.load = load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "orchestrator.config.inventory", module)
    return calls


def test_command_needs_no_inventory_when_all_given(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no cluster.yaml here
    calls = fake_inventory(monkeypatch, 9, None, None)
    make_imagefolder(tmp_path / "src", {"cat": 4})
    args = parse(["split-data", "-n", "2", "--source", "src", "--out", "shards"])
    assert split_data.run(args) == 0
    assert calls == [] and (tmp_path / "shards" / "worker_1_of_2").is_dir()


def test_command_defaults_from_inventory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    make_imagefolder(tmp_path / "src", {"cat": 6, "dog": 6})
    (tmp_path / "my.yaml").write_text("name: x\n")
    calls = fake_inventory(monkeypatch, 3, tmp_path / "src", tmp_path / "shards")
    args = argparse.Namespace(config=str(tmp_path / "my.yaml"), workers=None, source=None, out=None,
                              seed=0, pack=False, image_size=None)
    assert split_data.run(args) == 0
    assert calls == [tmp_path / "my.yaml"]
    assert sorted(manifest(tmp_path / "shards")["splits"]) == ["3"]
    assert "worker_2_of_3" in capsys.readouterr().out


def test_command_without_inventory_explains(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = parse(["split-data", "--source", "src", "--out", "shards"])
    with pytest.raises(OrchError) as err:
        split_data.run(args)
    assert err.value.exit_code == 2 and "cluster.yaml not found" in err.value.message
    assert "--workers" in err.value.message
    assert os.listdir(tmp_path) == []


def test_command_inventory_without_data_section(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text("name: x\n")
    fake_inventory(monkeypatch, 2, None, None)
    with pytest.raises(DataError, match=r"data\.source"):
        split_data.run(parse(["split-data"]))


def test_summary_is_short_for_many_workers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_records(tmp_path / "src", "train", 100)
    args = parse(["split-data", "-n", "100", "--source", str(tmp_path / "src"), "--out",
                  str(tmp_path / "o")])
    assert split_data.run(args) == 0
    printed = capsys.readouterr().out
    assert "worker_0_of_100" in printed and "worker_99_of_100" in printed
    assert "worker_50_of_100" not in printed and "84 more" in printed
    assert len(printed.splitlines()) < 40


def fake_packer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Path, int]]:
    calls: list[tuple[Path, int]] = []

    def pack_shard(shard_dir: Path, image_size: int) -> None:
        calls.append((Path(shard_dir), image_size))
        (Path(shard_dir) / "packed.bin").write_bytes(b"p" * image_size)

    module = types.ModuleType("worker.pack")
    module.pack_shard = pack_shard  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "worker.pack", module)
    return calls


def test_pack_calls_packer_per_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_packer(monkeypatch)
    make_imagefolder(tmp_path / "src", VGGF)
    out = tmp_path / "out"
    args = parse(["split-data", "-n", "2", "--source", str(tmp_path / "src"), "--out", str(out),
                  "--pack", "--image-size", "32"])
    assert split_data.run(args) == 0
    assert [size for _, size in calls] == [32, 32]
    for shard in manifest(out)["splits"]["2"]["shards"]:
        assert ["packed.bin", 32] in shard["files"]
        assert (out / shard["name"] / "packed.bin").read_bytes() == b"p" * 32


def test_pack_refuses_records_and_writes_nothing(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_packer(monkeypatch)
    make_records(tmp_path / "src", "train", 4)
    args = parse(["split-data", "-n", "2", "--source", str(tmp_path / "src"), "--out",
                  str(tmp_path / "o"),
                  "--pack"])
    with pytest.raises(DataError, match="ImageFolder"):
        split_data.run(args)
    assert calls == [] and not (tmp_path / "o").exists()


def test_image_size_without_pack_is_usage_error(tmp_path: Path) -> None:
    args = parse(["split-data", "-n", "2", "--source", "s", "--out", "o", "--image-size", "64"])
    with pytest.raises(UsageError):
        split_data.run(args)


def test_thread_pool_links_the_same(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_imagefolder(src, VGGF)
    splitdata.split(src, tmp_path / "one", 3, threads=1)
    splitdata.split(src, tmp_path / "four", 3, threads=4)
    assert manifest(tmp_path / "one") == manifest(tmp_path / "four")
    for i in range(3):
        name = f"worker_{i}_of_3"
        assert shard_files(tmp_path / "one", name) == shard_files(tmp_path / "four", name)


def test_failure_while_writing_keeps_previous_split(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, VGGF)
    splitdata.split(src, out, 2, seed=0)
    before = listing(out)
    real_rename, calls = os.rename, []

    def flaky_rename(a: str | Path, b: str | Path) -> None:
        calls.append(b)
        if len(calls) == 3:  # worker_0 retired and installed, then worker_1 fails midway
            raise OSError(28, "No space left on device", str(a))
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", flaky_rename)
    with pytest.raises(DataError, match="No space left"):
        splitdata.split(src, out, 2, seed=1)
    assert len(calls) > 3  # the rollback ran
    assert listing(out) == before


def test_pack_failure_keeps_previous_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    make_imagefolder(src, VGGF)
    splitdata.split(src, out, 2)
    before = listing(out)

    def broken(shard_dir: Path) -> None:
        raise OSError(5, "cannot identify image file", str(shard_dir / "TrainData/cat/img000.png"))

    with pytest.raises(DataError, match="cannot identify image"):
        splitdata.split(src, out, 2, pack=broken)
    assert listing(out) == before


def test_command_with_real_inventory_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    from orchestrator import cli  # orch's own CLI: failing to import it is a failure, not a skip
    make_imagefolder(tmp_path / "proj" / "data" / "src",
                     {"TrainData/cat": 6, "ValidationData/cat": 3})
    (tmp_path / "proj" / "c.yaml").write_text(
        "name: t\nhosts:\n  - address: localhost\n    connection: local\n    procs: 3\n"
        "data:\n  source: data/src\n  shards: data/shards\njob:\n  entrypoint: worker.train\n")
    monkeypatch.chdir(tmp_path)  # relative data paths resolve against the inventory's folder
    assert cli.cli(["split-data", "-c", "proj/c.yaml"]) == 0
    split = manifest(tmp_path / "proj" / "data" / "shards")["splits"]["3"]
    assert split["source"] == str((tmp_path / "proj" / "data" / "src").resolve())
    assert [s["classes"] for s in split["shards"]] == [{"TrainData/cat": 2,
                                                        "ValidationData/cat": 1}] * 3
    assert cli.cli(["split-data", "-c", "proj/c.yaml", "--workers", "4"]) == 2
    assert "fewer than the 4 workers" in capsys.readouterr().err


def test_table_counts_a_class_once_over_its_split_folders(tmp_path: Path) -> None:
    from rich.console import Console

    from orchestrator.commands.split_data import shard_table

    src = tmp_path / "src"
    make_imagefolder(src, {"TrainData/cat": 4, "ValidationData/cat": 2,
                           "TrainData/dog": 6, "ValidationData/dog": 2})
    plan = splitdata.split(src, tmp_path / "out", 2).plan
    console = Console(width=120, record=True)
    console.print(shard_table(plan))
    rows = [line.split("│") for line in console.export_text().splitlines() if "worker_" in line]
    cells = [[c.strip() for c in r[1:6]] for r in rows]
    # 2 classes, not 4 (TrainData/cat and ValidationData/cat are one); files per class summed.
    assert [[c[0], c[1], c[3], c[4]] for c in cells] == [
        ["worker_0_of_2", "7", "2", "3..4"], ["worker_1_of_2", "7", "2", "3..4"]]
