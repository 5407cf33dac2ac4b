"""`make gpu-check`: the GPU proof in one command; a table in bench/out/gpu.md.

    python3 bench/gpu_check.py [--python PY] [--bench-args "--steps 30"] [--skip-bench]

1. Finds a Python whose torch sees CUDA: ``--python`` (or ``$GPU_PYTHON``), else the
   repository's .venv, else ``python3``. None: it says so and exits 0, running nothing.
2. Checks that Python has the repository's dependencies (else: what is missing, exit 2).
3. Runs ``pytest -m gpu`` (tests/test_gpu.py: orch up on a local GPU host with NCCL,
   preflight against nvidia-smi, AMP, channels-last, SyncBatchNorm, fp16 and TernGrad
   gradients, checkpoints across devices, and with 2+ GPUs SyncBN and TernGrad over NCCL).
4. Runs bench/gpu.py (images/s at 224 px, loader efficiency).
5. Prints the report and writes it to ``--out`` (after each step, so a run cut short
   leaves what it had). Exit 0 when every test passed or was skipped and the bench ran.

Standard library only: it runs (and skips) with any Python.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import gputable  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "out" / "gpu.md"
NEEDED = ("torch", "torchvision", "numpy", "PIL", "matplotlib", "yaml", "rich", "pathspec",
          "paramiko", "pytest")
PROBE = f"needed = {NEEDED!r}\n" + """
import importlib.util, json, sys
info = {"python": sys.version.split()[0], "missing": [m for m in needed
        if importlib.util.find_spec(m) is None], "torch": None, "cuda": False, "gpus": []}
if "torch" not in info["missing"]:
    import torch
    info.update(torch=torch.__version__, cuda=torch.cuda.is_available(),
                cuda_version=torch.version.cuda)
    if info["cuda"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(json.dumps(info))
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 bench/gpu_check.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--python", default=os.environ.get("GPU_PYTHON") or None, metavar="PY",
                   help="interpreter to test with (default: $GPU_PYTHON, else .venv, else python3)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    p.add_argument("--bench-args", default="", metavar="ARGS",
                   help="extra arguments for bench/gpu.py, one string, e.g. \"--steps 30\"")
    p.add_argument("--pytest-args", default="", metavar="ARGS",
                   help="extra arguments for pytest, one string, e.g. \"-k orch_up\"")
    p.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    p.add_argument("--skip-bench", action="store_true", help="only the tests")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for name in ("bench_args", "pytest_args"):
        try:
            setattr(args, name, shlex.split(getattr(args, name)))
        except ValueError as e:
            p.error(f"--{name.replace('_', '-')}: {e} (fix: quote it as one shell word)")
    return args


# ---------------------------------------------------------------------------
# Which Python.


def candidates(explicit: str | None) -> list[str]:
    if explicit:
        return [explicit]
    found = [str(REPO / ".venv" / "bin" / "python"), shutil.which("python3") or "", sys.executable]
    out: list[str] = []
    for py in found:
        if py and Path(py).exists() and py not in out:
            out.append(py)
    return out


def probe(python: str) -> dict[str, Any]:
    """What ``python`` has: missing modules, torch's version, CUDA and its GPUs."""
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300,
                           stdin=subprocess.DEVNULL)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"error": "does not run", "missing": list(NEEDED), "torch": None, "cuda": False}


def describe(python: str, info: dict[str, Any]) -> str:
    if info.get("error"):
        return f"{python}: {info['error']}"
    if info["torch"] is None:
        return f"{python}: no torch"
    return f"{python}: torch {info['torch']}, " + (
        f"{len(info['gpus'])} GPU(s)" if info["cuda"] else "CUDA not available")


def choose_python(explicit: str | None) -> tuple[str | None, dict[str, Any], list[str]]:
    """(python, its probe, what was seen): the first candidate whose torch sees CUDA."""
    seen = []
    for py in candidates(explicit):
        info = probe(py)
        seen.append(describe(py, info))
        if info.get("cuda"):
            return py, info, seen
    return None, {}, seen


def missing_message(python: str, missing: list[str]) -> str:
    return (f"error: {python} has CUDA but lacks {', '.join(missing)}\n"
            f"  fix: {python} -m pip install -e '.[worker,dev]' (or `make install`); "
            "offline, carry wheels as README.md, section \"GPU check\", says")


# ---------------------------------------------------------------------------
# Steps.


def child_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONUNBUFFERED="1",
                PYTHONPATH=str(REPO) + (os.pathsep + path if path else ""))


def run_tests(python: str, junit: Path, extra: list[str]) -> int:
    cmd = [python, "-m", "pytest", "-m", "gpu", "tests", "-o", "addopts=", "-ra", "-q",
           "-p", "no:cacheprovider", f"--junitxml={junit}", *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL).returncode


def run_bench(python: str, json_path: Path, md_path: Path, extra: list[str]) -> int:
    cmd = [python, str(HERE / "gpu.py"), "--json", str(json_path), "--out", str(md_path), *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL).returncode


def nvidia_smi() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        return "; ".join(line.strip() for line in r.stdout.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError):
        return "(nvidia-smi did not run)"


def machine_section(python: str, info: dict[str, Any]) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"- date: {now}", f"- host: {platform.node()} ({os.cpu_count()} CPUs)",
             f"- GPUs: {', '.join(info['gpus'])}", f"- nvidia-smi: {nvidia_smi()}",
             f"- python: {python} ({info['python']}), torch {info['torch']}, "
             f"CUDA {info.get('cuda_version')}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Report.


def tests_section(rc: int | None, junit: Path) -> str:
    if rc is None:
        return "not run (--skip-tests)"
    if not junit.exists():
        return f"pytest exited {rc} before writing results"
    results = gputable.tests_from_junit(junit)
    return (f"{gputable.tests_summary(results)} (pytest exit {rc}).\n\n"
            f"{gputable.tests_table(results)}")


def bench_section(rc: int | None, json_path: Path) -> str:
    if rc is None:
        return "not run (--skip-bench)"
    if not json_path.exists():
        return f"bench/gpu.py exited {rc} before writing results"
    failed = f"bench/gpu.py exited {rc}: some measurements failed (see the table).\n\n"
    note = "" if rc == 0 else failed
    return note + gputable.bench_markdown(json.loads(json_path.read_text()))


def write_report(out: Path, machine: str, tests: str, bench: str) -> str:
    return gputable.write_markdown(out, "GPU check (make gpu-check)", [
        ("Machine", machine), ("Checks: pytest -m gpu", tests),
        ("Training throughput: bench/gpu.py", bench)])


def check(args: argparse.Namespace, python: str, info: dict[str, Any]) -> int:
    machine = machine_section(python, info)
    with tempfile.TemporaryDirectory(prefix="orch-gpu-check-") as tmp:
        junit = Path(tmp) / "junit.xml"
        # the raw results stay beside the report (gpu-bench.json), for tables in the docs
        bench_json, bench_md = args.out.with_name("gpu-bench.json"), args.out.with_name("gpu-bench.md")
        bench_json.unlink(missing_ok=True)
        write_report(args.out, machine, "running", "waiting")
        tests_rc = None if args.skip_tests else run_tests(python, junit, args.pytest_args)
        tests = tests_section(tests_rc, junit)
        write_report(args.out, machine, tests, "running" if not args.skip_bench else "waiting")
        bench_rc = (None if args.skip_bench
                    else run_bench(python, bench_json, bench_md, args.bench_args))
        text = write_report(args.out, machine, tests, bench_section(bench_rc, bench_json))
    print(text)
    print(f"wrote {args.out}")
    return 0 if tests_rc in (None, 0) and bench_rc in (None, 0) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    python, info, seen = choose_python(args.python)
    if python is None and args.python and not Path(args.python).exists():
        print(f"error: --python {args.python}: no such file (fix: name an interpreter that "
              "exists, or leave --python and $GPU_PYTHON out)", file=sys.stderr)
        return 2
    if python is None:
        print("no CUDA GPU: skipping the GPU check (looked with " + "; ".join(seen) + ")")
        return 0
    if info["missing"]:
        print(missing_message(python, info["missing"]), file=sys.stderr)
        return 2
    print(f"GPU check with {describe(python, info)}: {', '.join(info['gpus'])}", flush=True)
    return check(args, python, info)


if __name__ == "__main__":
    sys.exit(main())
