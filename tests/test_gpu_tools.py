"""What of the GPU check a CPU can run: `make gpu-check` and bench/gpu.py without CUDA
(they say so and exit 0), their arguments, the report tables, the bench harness itself on
the CPU, the GPU code paths that also run on the CPU, and preflight's GPU count through a
stand-in nvidia-smi. The GPU checks themselves are tests/test_gpu.py (`-m gpu`).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu as bench_gpu  # noqa: E402
import gpu_check  # noqa: E402
import gpu_standin  # noqa: E402
import gputable  # noqa: E402
from helpers import orch_in_process, wait_until  # noqa: E402
from sshd_cluster import pids_with_env  # noqa: E402
from worker import compression as C  # noqa: E402
from worker.augment import crops_by_grid, crops_by_interpolate, draw_boxes, resized_crop_flip  # noqa: E402

NO_CUDA = {"CUDA_VISIBLE_DEVICES": ""}  # the skip path, also on a machine with a GPU


def run(argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO,
        timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """argv's result; env adds to (or overrides) this process's environment."""
    return subprocess.run(argv, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- the skip path


@pytest.mark.slow  # starts Python with torch (and make, pytest) in a subprocess
def test_make_gpu_check_without_cuda_says_so_and_exits_0() -> None:
    r = run(["make", "-s", "gpu-check"], NO_CUDA)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("no CUDA GPU: skipping the GPU check (looked with ")
    assert "CUDA not available" in r.stdout
    assert r.stdout.count("\n") == 1  # that one line: nothing was run


@pytest.mark.slow  # starts Python with torch (the probe) in a subprocess
def test_gpu_check_without_cuda_writes_no_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """main in this process, choose_python's answer read on its way: one probe (a torch
    import, ~4 s of CPU) where the script and choose_python each made one. The script
    as a process: test_make_gpu_check_without_cuda_says_so_and_exits_0."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # the probe's Python inherits it
    chosen: list[tuple[str | None, dict[str, Any], list[str]]] = []
    choose = gpu_check.choose_python

    def spy(python: str | None) -> tuple[str | None, dict[str, Any], list[str]]:
        chosen.append(choose(python))
        return chosen[-1]
    monkeypatch.setattr(gpu_check, "choose_python", spy)
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--python", sys.executable, "--out", str(out)]) == 0
    said = f"{sys.executable}: torch {torch.__version__}, CUDA not available"
    assert chosen == [(None, {}, [said])]   # no Python, and what it saw named
    assert said in capsys.readouterr().out
    assert not out.exists()


def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch says without a GPU (CUDA_VISIBLE_DEVICES= in a new process): in this
    process, where a new one only imported torch again (~4 s of CPU) to read it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_gpu_bench_without_cuda_says_so_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    no_cuda(monkeypatch)
    out = tmp_path / "bench.md"
    assert bench_gpu.main(["--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("no CUDA GPU: skipping bench/gpu.py")
    assert not out.exists()


def test_gpu_loader_bench_without_cuda_says_so_and_exits_0(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_loader

    no_cuda(monkeypatch)
    assert gpu_loader.main(["--batches", "3"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA GPU: skipping bench/gpu_loader.py")


def test_probe_lists_missing_modules(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    info = gpu_check.probe(str(bare / "bin" / "python"))
    assert info["torch"] is None and info["cuda"] is False
    assert set(info["missing"]) == set(gpu_check.NEEDED)
    assert "lacks torch, torchvision" in gpu_check.missing_message("py", info["missing"])


# ---------------------------------------------------------------- arguments


def test_gpu_check_arguments(tmp_path: Path) -> None:
    args = gpu_check.parse_args(["--bench-args", "--steps 30 --models resnet50", "--out",
                                 str(tmp_path)])
    assert args.bench_args == ["--steps", "30", "--models", "resnet50"] and args.pytest_args == []
    r = run([sys.executable, "bench/gpu_check.py", "--bench-args", '"--steps'])
    assert r.returncode == 2 and "--bench-args: No closing quotation" in r.stderr
    r = run([sys.executable, "bench/gpu_check.py", "--python", str(tmp_path / "nope")])
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_gpu_bench_defaults_and_lists() -> None:
    a = bench_gpu.parse_args([])
    assert (a.models, a.batch_sizes, a.modes) == (["resnet50", "vggf"], [64, 128],
                                                  ["fp32", "amp", "amp-cl"])
    assert a.inputs == ["synthetic", "synthetic-aug", "packed", "packed-torch", "imagefolder"]
    assert (a.image_size, a.device, a.out) == (224, "cuda", REPO / "bench" / "out" / "gpu-bench.md")
    a = bench_gpu.parse_args(["--models", "vggf", "--batch-sizes", "32,256", "--modes", "amp-cl",
                              "--inputs", "synthetic,packed", "--workers", "12"])
    assert (a.models, a.batch_sizes, a.modes, a.inputs, a.workers) == (
        ["vggf"], [32, 256], ["amp-cl"], ["synthetic", "packed"], 12)


@pytest.mark.parametrize("argv, message", [
    (["--models", "resnet51"], "resnet51: choose from resnet50,vggf"),
    (["--modes", "fp32,bf16"], "bf16: choose from fp32,amp,amp-cl"),
    (["--inputs", ""], "choose from synthetic,synthetic-aug,packed,packed-torch,imagefolder"),
    (["--batch-sizes", "64,0"], "give whole numbers >= 1"),
    (["--steps", "ten"], "give a whole number >= 1"),
    (["--device", "cpu"], "--device cpu measures fp32 only: add --modes fp32"),
])
def test_gpu_bench_refuses_bad_arguments(argv: list[str], message: str,
                                         capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_gpu.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the tables

RESULTS: list[dict[str, Any]] = [
    {"model": "resnet50", "batch": 64, "mode": "amp", "input": "synthetic", "images_per_s": 1000.0},
    {"model": "resnet50", "batch": 64, "mode": "amp", "input": "packed", "images_per_s": 950.0},
    {"model": "resnet50", "batch": 64, "mode": "amp", "input": "packed-torch",
     "images_per_s": 700.0},
    {"model": "resnet50", "batch": 64, "mode": "amp", "input": "imagefolder",
     "images_per_s": 400.0},
    {"model": "vggf", "batch": 128, "mode": "fp32", "input": "synthetic", "images_per_s": 500.0},
    {"model": "vggf", "batch": 128, "mode": "fp32", "input": "packed", "images_per_s": 400.0},
    {"model": "vggf", "batch": 128, "mode": "fp32", "input": "imagefolder",
     "error": "out of GPU memory"},
]


def test_efficiency_is_packed_over_synthetic_per_configuration() -> None:
    assert gputable.efficiency_rows(RESULTS) == [
        ("resnet50", 64, "amp", "1000", "0.95", "met", "0.70", "0.40"),
        ("vggf", 128, "fp32", "500", "0.80", "NOT met", "-", "-"),
    ]


def test_efficiency_summary_says_where_each_loader_lands() -> None:
    assert gputable.efficiency_summary(RESULTS) == (
        "Packed loader: 0.80-0.95 of synthetic (target >= 0.9: met in 1 of 2). "
        "ImageFolder + PIL: 0.40 of synthetic.")
    assert gputable.efficiency_summary(RESULTS[:1]) == "No loader was measured against synthetic."


def test_throughput_table_is_markdown_with_ratios_and_errors() -> None:
    lines = gputable.throughput_table(RESULTS).splitlines()
    assert lines[0] == "| model | batch | precision | input | images/s | / synthetic |"
    assert lines[1] == "|---|---|---|---|---|---|"
    assert lines[3] == "| resnet50 | 64 | amp | packed | 950 | 0.95 |"
    assert lines[8] == "| vggf | 128 | fp32 | imagefolder | (out of GPU memory) | - |"
    assert gputable.markdown_table(["a"], [["x|y"]]).splitlines()[2] == "| x\\|y |"


def test_write_markdown_replaces_the_file_whole(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "gpu.md"
    text = gputable.write_markdown(out, "T", [("One", "body 1\n"), ("Two", "| a |")])
    assert out.read_text() == text == "# T\n\n## One\n\nbody 1\n\n## Two\n\n| a |\n"
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpu.md"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_a" time="1.25" />
<testcase classname="tests.test_gpu" name="test_b[amp]" time="2.0">
  <failure message="AssertionError: val_acc 0.91&#10;second line">trace</failure></testcase>
<testcase classname="tests.test_gpu" name="test_c" time="0.5">
  <error message="fixture broke" /></testcase>
<testcase classname="tests.test_gpu" name="test_d" time="0.0">
  <skipped type="pytest.skip" message="needs 2 CUDA GPUs, found 1" /></testcase>
</testsuite></testsuites>"""


def test_junit_results_become_rows(tmp_path: Path) -> None:
    (tmp_path / "j.xml").write_text(JUNIT)
    rows = gputable.tests_from_junit(tmp_path / "j.xml")
    assert [(r.name, r.outcome, r.seconds, r.detail) for r in rows] == [
        ("test_gpu::test_a", "passed", 1.25, ""),
        ("test_gpu::test_b[amp]", "failed", 2.0, "AssertionError: val_acc 0.91"),
        ("test_gpu::test_c", "error", 0.5, "fixture broke"),
        ("test_gpu::test_d", "skipped: needs 2 CUDA GPUs, found 1", 0.0, ""),
    ]
    assert gputable.tests_summary(rows) == "1 error, 1 failed, 1 passed, 1 skipped"
    assert ("| test_gpu::test_b[amp] | failed | 2.0 | AssertionError: val_acc 0.91 |"
            in gputable.tests_table(rows))


@pytest.mark.slow  # starts Python with torch (and make, pytest) in a subprocess
def test_gpu_tests_without_cuda_are_reported_skipped_not_passed(tmp_path: Path) -> None:
    """The real `pytest -m gpu` run of make gpu-check, on a machine without CUDA."""
    junit = tmp_path / "junit.xml"
    r = run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-o", "addopts=",
             "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"], NO_CUDA)
    assert r.returncode == 0, r.stdout[-2000:]
    rows = gputable.tests_from_junit(junit)
    assert len(rows) >= 15
    assert {r.outcome for r in rows} == {"skipped: no CUDA"}
    section = gpu_check.tests_section(r.returncode, junit)
    assert section.startswith(f"{len(rows)} skipped (pytest exit 0).")
    assert "passed" not in section


def test_report_sections(tmp_path: Path) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"env": {"gpu": "H100"}, "config": {"device": "cuda"},
                                 "results": RESULTS}))
    text = gpu_check.write_report(tmp_path / "gpu.md", "- GPUs: H100", "3 passed",
                                  gpu_check.bench_section(1, bench))
    assert (tmp_path / "gpu.md").read_text() == text
    for part in ("# GPU check (make gpu-check)", "## Machine", "## Checks: pytest -m gpu",
                 "## Training throughput: bench/gpu.py", "bench/gpu.py exited 1",
                 "Set-up: gpu H100, device cuda.",
                 "| resnet50 | 64 | amp | 1000 | 0.95 | met | 0.70 | 0.40 |",
                 "met in 1 of 2"):
        assert part in text
    assert gpu_check.bench_section(None, bench) == "not run (--skip-bench)"
    assert (gpu_check.bench_section(3, tmp_path / "none.json")
            == "bench/gpu.py exited 3 before writing results")


# ---------------------------------------------------------------- the harness on the CPU


@pytest.mark.slow
def test_gpu_bench_harness_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench/gpu.py's main in this process (on one thread, tests/conftest.py), where a new
    one imported torch and torchvision again (~4 s of CPU); its loader processes are
    this process's children, as they were the bench's."""
    out, js = tmp_path / "b.md", tmp_path / "b.json"
    before = set(multiprocessing.active_children())
    rc = bench_gpu.main(["--device", "cpu", "--modes", "fp32",
                         "--models", "lenet", "--batch-sizes", "8", "--image-size", "32",
                         "--source-size", "40", "--images", "48", "--steps", "3", "--warmup", "1",
                         "--workers", "1", "--out", str(out), "--json", str(js)])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout[-2000:]
    # a forked loader does not show an environment marker set here (/proc/PID/environ is
    # what the exec had): the loaders are found as the children they are
    wait_until(lambda: not set(multiprocessing.active_children()) - before, 10,
               "the bench's loader processes to end")
    results = json.loads(js.read_text())["results"]
    assert [x["input"] for x in results] == ["synthetic", "synthetic-aug", "packed", "packed-torch",
                                             "imagefolder"]
    for x in results:
        assert x["images"] == 24 and x["images_per_s"] > 0 and "error" not in x
    text = out.read_text()
    assert "| lenet | 8 | fp32 | packed |" in text and "packed / synthetic" in text
    assert text in stdout


# ---------------------------------------------------------------- GPU code paths, on the CPU


def test_batch_resized_crop_equals_per_image_resize() -> None:
    """The GPU's one grid_sample per batch samples what the CPU's per-image resize does."""
    x = torch.randint(0, 256, (24, 3, 40, 56), dtype=torch.uint8).float()
    boxes = draw_boxes(24, 40, 56, torch.Generator().manual_seed(3))
    assert boxes[4].any() and not boxes[4].all()  # some flipped, some not
    torch.testing.assert_close(crops_by_grid(x, boxes), crops_by_interpolate(x, boxes),
                               atol=2e-3, rtol=0)


def test_resized_crop_on_cpu_keeps_its_draws() -> None:
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    a = resized_crop_flip(x, torch.Generator().manual_seed(5))
    b = crops_by_interpolate(x, draw_boxes(6, 32, 32, torch.Generator().manual_seed(5)))
    assert a.dtype == torch.uint8 and torch.equal(a, b)


@pytest.fixture
def no_host_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor -> Python conversions raise: on a GPU each would copy to the host and wait."""
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a host transfer in the codec's hot path")
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_terngrad_codec_makes_no_host_transfer(no_host_transfers: None) -> None:
    grad = torch.randn(1001)
    gen = torch.Generator().manual_seed(0)
    scaler = C.local_scaler(grad, clip_factor=2.5)
    packed = C.encode(grad, scaler, gen)
    decoded = C.decode(packed, scaler, grad.numel())
    C.sum_codes([packed, packed, packed])
    layout = C._Layout(quant=[(0, 600)], floats=[(600, 401)])
    payload = torch.cat([C.pack_ternary(C.ternarize(grad[:600], scaler, gen)),
                         grad[600:].contiguous().view(torch.uint8)])
    buf = grad.clone()
    C._average_into(buf, [payload, payload], layout, scaler.reshape(1))
    assert decoded.shape == grad.shape and torch.equal(buf[600:], grad[600:])


# ---------------------------------------------------------------- preflight counts GPUs


@pytest.mark.parametrize("listed, asked", [(1, 2), (None, 1)])
def test_preflight_refuses_more_gpus_than_nvidia_smi_lists(tmp_path: Path, listed: int | None,
                                                           asked: int) -> None:
    path = os.environ["PATH"]
    env = {"ORCH_GPU_CLAIMS_DIR": str(tmp_path / "claims")}
    if listed is not None:
        gpu_standin.install(tmp_path / "bin")
        gpu_standin.describe(tmp_path, "local", listed)
        path = f"{tmp_path / 'bin'}{os.pathsep}{path}"
        env["ORCH_FAKE_GPUS_DIR"] = str(tmp_path)
    (tmp_path / "cluster.yaml").write_text(textwrap.dedent(f"""\
        name: gpu-preflight
        hosts:
          - address: localhost
            connection: local
            gpus: {asked}
            remote_dir: node
        python: {sys.executable}
        job:
          entrypoint: job.py
        """))
    r = orch_in_process(tmp_path, "up", "cluster.yaml",   # the host's agent: a new process
                        env={**os.environ, "PATH": path, "ORCH_NO_COLOR": "1", **env})
    text = r.stdout + r.stderr
    found = listed or 0
    assert r.returncode == 3, text
    assert f"{asked} GPU{'s' if asked > 1 else ''} asked for, {found} found (nvidia-smi" in text
    assert f"set gpus: {found} for this host" in text and "Traceback" not in text
    assert pids_with_env(f"ORCH_JOB_DIR={tmp_path / 'node' / 'gpu-preflight'}") == []
