"""GPU checks, `pytest -m gpu` (run by `make gpu-check`). Every test here needs CUDA and is
skipped with "no CUDA" without it; the multi-GPU ones need 2 GPUs.

- orch up on a `connection: local` host with `gpus: 1` (2 where there are 2): NCCL, demo
  to target; preflight reads nvidia-smi and refuses one GPU more than it lists, and a GPU
  held by another process (this one), naming it; while a job runs, the rank's
  CUDA_VISIBLE_DEVICES and `orch status`'s GPU rows against the real nvidia-smi; a stalled
  NCCL collective reported as a hang with NCCL's flight recorder dump;
- --amp, --channels-last, --sync-bn, --grad-compression fp16|terngrad: demo to target;
- checkpoint on CPU -> --resume on GPU -> --resume on CPU again;
- the TernGrad codec and the input path stay on the GPU, with no host synchronisation;
  packed batches through the page-locked ring arrive intact over two epochs;
- 2+ GPUs: SyncBatchNorm over 2 NCCL ranks = BatchNorm on the concatenated batch;
  TernGrad's hook over NCCL all_gather.
"""
from __future__ import annotations

import copy
import csv
import getpass
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import orch, spawn_ranks
from sshd_cluster import pids_with_env
from test_worker_common import Torchrun, split, torchrun  # noqa: F401 (torchrun: fixture)
from worker import compression as C
from worker import demo_data
from worker.augment import augment, crops_by_grid, crops_by_interpolate, draw_boxes, normalize
from worker.data import DevicePrefetcher, EpochSampler, make_loader

REPO = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
RANKS = min(GPUS, 2)  # ranks of the training runs: 2 where there are 2 GPUs
SPAWN_TIMEOUT_S = 180

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="no CUDA" if not CUDA else
                              f"needs 2 CUDA GPUs, found {GPUS}")

# The shipped demo's job (cluster.yaml), 32 px LeNet with Adam, stopping at 0.95.
DEMO = ["--model", "lenet", "--image-size", "32", "--batch-size", "32", "--optimizer", "adam",
        "--lr", "0.001", "--workers", "0", "--target-accuracy", "0.95", "--patience", "1"]
TARGET = 0.95


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The demo data set (6 classes x 300 + 50 images, 32 px) split for 1 and RANKS ranks."""
    root = tmp_path_factory.mktemp("gpu-demo")
    data = demo_data.generate(root / "demo", seed=0)
    return {w: split(data, root / f"shards{w}", w) for w in {1, RANKS}}


def metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def train(runner: Torchrun, nproc: int, args: list[str], data: Path, out: Path) -> str:
    rc, output = runner.run(nproc, args, data, out, timeout=400)
    log = runner.rank_log(0, "stdout") + runner.rank_log(0, "stderr")
    assert rc == 0, output[-3000:] + log[-3000:]
    return log


# ---------------------------------------------------------------- orch up on a local GPU host
# These come first in the file: an in-process CUDA test below leaves this process holding
# a context on GPU 0 until it exits, and preflight then (rightly) finds that GPU taken.


def _free_gpu_here() -> None:
    assert not torch.cuda.is_initialized(), (
        "this test process already holds a CUDA context, so preflight finds its GPU taken: "
        "run the orch up checks before the in-process CUDA ones (file order)")


def _inventory(tmp: Path, gpus: int, args: list[str] | None = None,
               entrypoint: str = "worker.train", job_extra: str = "") -> Path:
    if not (tmp / "worker").exists():
        (tmp / "worker").symlink_to(REPO / "worker")
    argv = [*DEMO, "--epochs", "30", "--dist-backend", "nccl"] if args is None else args
    job_args = ", ".join(f'"{a}"' for a in argv)
    (tmp / "cluster.yaml").write_text(f"""\
name: gpu-check
hosts:
  - address: localhost
    connection: local
    gpus: {gpus}
    remote_dir: node0
python: {sys.executable}
code:
  paths: [worker]
  exclude: ["*.pyc", "__pycache__"]
data:
  source: data/demo
  shards: data/demo-shards
job:
  entrypoint: {entrypoint}
  args: [{job_args}]
{job_extra}""")
    return tmp / "cluster.yaml"


def _orch(tmp: Path, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # extends PYTHONPATH: offline, paramiko may come from carried wheels (README, "GPU check")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, ORCH_NO_COLOR="1")
    return orch(tmp, *argv, env=env, timeout=timeout)


def _job_pids(tmp: Path) -> list[int]:
    return pids_with_env(f"ORCH_JOB_DIR={tmp / 'node0' / 'gpu-check'}")


@pytest.fixture
def gpu_cluster(tmp_path: Path, demo: dict[int, Path]) -> Iterator[Callable[..., Path]]:
    """cluster.yaml for one local host with ``gpus`` GPUs; afterwards no process of it is left."""
    shutil.copytree(demo[1].parent / "demo", tmp_path / "data" / "demo")
    yield lambda gpus, **kw: _inventory(tmp_path, gpus, **kw)
    deadline = time.monotonic() + 15
    while _job_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _job_pids(tmp_path) == [], "a process of the job was left behind"


@pytest.mark.slow
def test_orch_up_on_a_local_gpu_host_trains_with_nccl(gpu_cluster: Callable,
                                                      tmp_path: Path) -> None:
    _free_gpu_here()
    gpu_cluster(RANKS)  # 1 GPU, or 2 ranks where there are 2 (the demo's lr is for 1-2)
    split_run = _orch(tmp_path, "split-data")
    assert split_run.returncode == 0, split_run.stdout + split_run.stderr
    up = _orch(tmp_path, "up", "cluster.yaml")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert f"worker.train: {RANKS} process(es), backend nccl" in up.stdout
    for rank in range(RANKS):
        assert f"[r{rank} " in up.stdout
    rows = metrics(tmp_path / "node0" / "gpu-check" / "output")
    assert float(rows[-1]["val_acc"]) >= TARGET


def _routed_interface() -> str | None:
    """This machine's first interface that is up, not loopback and has an IPv4 address
    (what a user names in `network.interface`), from the agent's own reading."""
    from orchestrator.agent.network import interfaces
    for i in interfaces():
        if i["up"] and i["name"] != "lo" and any(not a.startswith("127.") for a in i["addrs"]):
            return str(i["name"])
    return None


def test_nccl_bootstraps_on_the_interface_orch_sets(gpu_cluster: Callable,
                                                    tmp_path: Path) -> None:
    """`network.interface` on a GPU host: orch checks the name against the host's
    interfaces, sets NCCL_SOCKET_IFNAME (and GLOO's) for the ranks, and NCCL's own log
    shows its bootstrap on that interface, not on lo."""
    _free_gpu_here()
    iface = _routed_interface()
    if iface is None:
        pytest.skip("no interface but lo with an IPv4 address on this machine")
    env = "  env: {NCCL_DEBUG: INFO, NCCL_DEBUG_SUBSYS: 'INIT,BOOTSTRAP,ENV,NET'}\n"
    gpu_cluster(1, args=[*DEMO, "--epochs", "1", "--dist-backend", "nccl"],
                job_extra=env + f"network: {{interface: {iface}}}\n")
    assert _orch(tmp_path, "split-data").returncode == 0
    up = _orch(tmp_path, "up", "cluster.yaml")
    out = up.stdout + up.stderr
    assert up.returncode == 0, out[-3000:]
    assert f"interface {iface} on localhost (network.interface" in out, out[-3000:]
    assert f"NCCL_SOCKET_IFNAME set by environment to {iface}" in out, out[-3000:]
    used = re.findall(r"(?:Bootstrap|NET/Socket) ?: Using (.*)", out)
    assert used and all(iface in u and "lo:" not in u for u in used), (used, out[-3000:])


def test_preflight_refuses_more_gpus_than_nvidia_smi_lists(gpu_cluster: Callable,
                                                           tmp_path: Path) -> None:
    assert shutil.which("nvidia-smi"), \
        "preflight counts GPUs with nvidia-smi -L: it must be on PATH"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    assert sum(line.startswith("GPU ") for line in listed.splitlines()) == GPUS
    gpu_cluster(GPUS + 1)
    assert _orch(tmp_path, "split-data", "--workers", str(GPUS + 1)).returncode == 0
    up = _orch(tmp_path, "up", "cluster.yaml", timeout=120)
    text = up.stdout + up.stderr
    assert up.returncode == 3, text
    assert f"{GPUS + 1} GPUs asked for, {GPUS} found (nvidia-smi)" in text
    assert f"set gpus: {GPUS} for this host" in text
    assert "Traceback" not in text


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [e.decode(errors="replace").partition("=") for e in f.read().split(b"\0") if e]
    return {k: v for k, _, v in pairs}


def _status_gpus(tmp: Path) -> list[dict]:
    st = _orch(tmp, "status", "--json", timeout=60)
    assert st.returncode in (0, 1), st.stdout + st.stderr
    return json.loads(st.stdout)["gpus"]


@pytest.mark.slow
def test_claim_env_and_status_rows_against_the_real_nvidia_smi(gpu_cluster: Callable,
                                                               tmp_path: Path) -> None:
    """While the job runs: the rank sees exactly its claimed GPU (CUDA_VISIBLE_DEVICES, in
    PCI bus order), and `orch status` finds nvidia-smi's compute process on GPU 0 to be
    this job's rank 0; once stopped, nothing of it is left and the GPU is free again."""
    _free_gpu_here()
    gpu_cluster(1, args=[*DEMO[:-4], "--epochs", "100000", "--dist-backend", "nccl"])
    assert _orch(tmp_path, "split-data", "--workers", "1").returncode == 0
    up = _orch(tmp_path, "up", "cluster.yaml", "--detach", timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    try:
        mine: list[dict] = []
        deadline = time.monotonic() + 120
        while not mine and time.monotonic() < deadline:
            gpus = _status_gpus(tmp_path)
            mine = [g for g in gpus if g["holder"] == "this job" and g["pids"]]
            time.sleep(1)
        assert mine, gpus
        g = mine[0]
        name = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()   # not torch's:
        assert (g["index"], g["ranks"]) == (0, [0]) and g["name"] == name   # no context here
        assert g["mem_total"] > 0 and g["mem_used"] > 0
        ranks = [p for p in _job_pids(tmp_path) if _environ(p).get("RANK") == "0"
                 and "worker.train" in Path(f"/proc/{p}/cmdline").read_text()]
        assert ranks and set(ranks) & set(g["pids"]), (ranks, g)
        env = _environ(ranks[0])
        assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("0", "PCI_BUS_ID")
        assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        shown = _orch(tmp_path, "status", timeout=60).stdout
        assert "this job, rank 0" in shown and name in shown, shown
    finally:
        stop = _orch(tmp_path, "stop", timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(g["holder"] != "free" for g in _status_gpus(tmp_path)):
        time.sleep(0.5)
    assert [g["holder"] for g in _status_gpus(tmp_path)] == ["free"] * GPUS


HANG = """\
import datetime, os, torch, torch.distributed as dist
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
torch.cuda.set_device(dev)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=4), device_id=dev)
x = torch.ones(1, device=dev)
dist.all_reduce(x)
torch.cuda.synchronize()
print("first all_reduce done", flush=True)
torch.cuda._sleep(2 ** 62)        # the stream is busy "forever": the next collective stalls
dist.all_reduce(x)
torch.cuda.synchronize()
"""


@pytest.mark.slow
def _nvidia_smi_gpus() -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def test_the_dashboards_gpu_view_against_the_real_nvidia_smi(gpu_cluster: Callable,
                                                             tmp_path: Path) -> None:
    """`orch dashboard`'s hosts view while the job trains: each GPU sampled on the host
    through the agent's connection has nvidia-smi's name and total memory, a utilisation
    in 0-100 and memory in use, and is "this job, rank 0"; served behind the token."""
    _free_gpu_here()
    import urllib.request

    from orchestrator.dashboard import page
    path = gpu_cluster(1)
    assert _orch(tmp_path, "split-data").returncode == 0
    up = _orch(tmp_path, "up", "--detach", "cluster.yaml")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    opened = page.open_for_job(str(path), gpu_every=1.0)
    try:
        def state() -> dict:
            with urllib.request.urlopen(opened.url.replace("/?", "/api/state?"), timeout=10) as r:
                return json.loads(r.read())
        deadline, gpus = time.monotonic() + 90, list[dict]()
        while time.monotonic() < deadline:
            gpus = state().get("gpus") or []
            if gpus and len(gpus[0]["samples"]) >= 3 and gpus[0]["samples"][-1][2]:
                break
            time.sleep(1.0)
        smi = _nvidia_smi_gpus()
        assert [g["index"] for g in gpus] == [int(row[0]) for row in smi], (gpus, smi)
        g = gpus[0]
        assert g["name"] == smi[0][1] and g["holder"] == "this job, rank 0", g
        _, util, used, total = g["samples"][-1]
        assert total == float(smi[0][2]) and 0 < used <= total, g["samples"][-3:]
        assert util is not None and 0 <= util <= 100, g["samples"][-3:]
    finally:
        opened.close()
        _orch(tmp_path, "stop", "cluster.yaml")


def test_a_stalled_nccl_collective_is_reported_with_its_flight_recorder_dump(
        gpu_cluster: Callable, tmp_path: Path) -> None:
    """NCCL's watchdog times the stalled collective out (4 s) and, with orch's flight
    recorder settings, dumps its trace into run/; orch's hang report (hang_timeout 12 s)
    names the file beside every rank's stack, and the job is stopped."""
    _free_gpu_here()
    (tmp_path / "hang.py").write_text(HANG)
    gpu_cluster(1, entrypoint="hang.py", args=[], job_extra=(
        "  hang_timeout: 12\n"
        "  env: {TORCH_NCCL_ASYNC_ERROR_HANDLING: \"0\"}\n"))   # dump, and stay alive
    text = (tmp_path / "cluster.yaml").read_text().replace("paths: [worker]",
                                                             "paths: [worker, hang.py]")
    (tmp_path / "cluster.yaml").write_text(text)
    assert _orch(tmp_path, "split-data", "--workers", "1").returncode == 0
    up = _orch(tmp_path, "up", "cluster.yaml", timeout=300)
    out = up.stdout + up.stderr
    assert up.returncode == 1, out[-4000:]
    assert "first all_reduce done" in out and "Traceback" not in out.split("first all_reduce")[0]
    named = re.findall(r"NCCL flight recorder dump: [^:]+: (\S+)", out)
    assert named, out[-4000:]
    dump = Path(named[0]) if Path(named[0]).is_absolute() else tmp_path / named[0]
    assert dump.name.startswith("nccl-trace-rank-0") and dump.stat().st_size > 0, named


def test_preflight_names_the_process_that_holds_the_gpu(gpu_cluster: Callable,
                                                        tmp_path: Path) -> None:
    """This test process takes a CUDA context on GPU 0: nvidia-smi lists it as a compute
    process, and orch refuses the GPU, naming the pid and its user."""
    torch.zeros(1, device="cuda")
    gpu_cluster(GPUS)
    assert _orch(tmp_path, "split-data", "--workers", str(GPUS)).returncode == 0
    up = _orch(tmp_path, "up", "cluster.yaml", timeout=120)
    text = up.stdout + up.stderr
    assert up.returncode == 3, text
    assert f"GPU 0 held by pid {os.getpid()} (user {getpass.getuser()}), not an orch job" in text
    assert "orch up --wait" in text and "Traceback" not in text


# ---------------------------------------------------------------- in-process: no host sync


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Any synchronising CUDA call inside (.item(), .cpu(), a blocking copy) raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_terngrad_codec_stays_on_the_gpu_without_host_sync() -> None:
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    grad = torch.randn(10_001, device=cuda)
    with no_host_sync():
        scaler = C.local_scaler(grad, clip_factor=2.5)
        packed = C.encode(grad, scaler, gen)
        decoded = C.decode(packed, scaler, grad.numel())
        sums = C.sum_codes([packed, packed])
        layout = C._Layout(quant=[(0, 6000), (6000, 4001)], floats=[])
        buf, shared = grad.clone(), torch.stack([scaler, scaler])
        C._average_into(buf, [packed, packed], layout, shared)
        nearest = C.ternarize_nearest(grad, scaler)  # --error-feedback's codes
    for t in (scaler, packed, decoded, sums, buf, nearest):
        assert t.device.type == "cuda"
    assert packed.numel() == 2501 and packed.dtype == torch.uint8
    values = set(torch.unique(decoded / scaler).tolist())
    assert values <= {-1.0, 0.0, 1.0} and len(values) == 3
    # two identical ranks: the average is the decoded ternary itself
    torch.testing.assert_close(buf, decoded)
    torch.testing.assert_close(C.decode(packed.cpu(), scaler.cpu(), grad.numel()), decoded.cpu())


def test_augmentation_on_the_gpu_matches_the_cpu_and_does_not_sync() -> None:
    x = torch.randint(0, 256, (16, 3, 64, 48), dtype=torch.uint8)
    boxes = draw_boxes(16, 64, 48, torch.Generator().manual_seed(0))
    on_device = x.cuda()
    with no_host_sync():
        on_gpu = crops_by_grid(on_device, boxes)
        out = augment(on_device, "resized_crop_flip")
        small = normalize(augment(on_device, "crop_flip"))
    for t in (on_gpu, out, small):
        assert t.device.type == "cuda" and t.dtype == torch.float32
    # pixels 0..255: float rounding of the sample points on the GPU stays far below 0.05
    torch.testing.assert_close(on_gpu.cpu(), crops_by_interpolate(x.float(), boxes),
                               atol=5e-2, rtol=0)


class _Batches(torch.utils.data.Dataset):
    """dataset[indices] -> (uint8 NHWC, labels) whose pixels encode the indices."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(indices)
        return idx.view(-1, 1, 1, 1).expand(-1, 4, 4, 3).to(torch.uint8).contiguous(), idx


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher_delivers_every_batch_pinned_and_on_the_gpu(workers: int) -> None:
    sampler = EpochSampler(100, 16, seed=0, rank=0)
    loader = make_loader(_Batches(), sampler, workers, pin_memory=True)
    expected = [y.clone() for _, y in loader]
    assert all(x.is_pinned() for x, _ in loader)
    got = list(DevicePrefetcher(loader, torch.device("cuda")))
    assert len(got) == len(expected) == 7
    for (x, y), want in zip(got, expected):
        assert x.device.type == "cuda" and y.device.type == "cuda"
        assert torch.equal(y.cpu(), want) and torch.equal(x[:, 0, 0, 0].long().cpu(), want)
    assert DevicePrefetcher(loader, torch.device("cuda")).sampler is sampler


@pytest.mark.parametrize("workers", [1, 3])
def test_ring_batches_arrive_on_the_gpu_intact_over_epochs(tmp_path: Path, workers: int) -> None:
    """Packed batches through the page-locked ring (worker/ring.py): every batch of two
    epochs (one cut short, as a break leaves it) is the sampled images and labels, while
    the GPU holds earlier batches and the loader processes write later slots."""
    from worker import pack
    from worker.packed import PackedBatches

    shard = demo_data.generate(tmp_path / "d", classes=3, train_per_class=40, val_per_class=1,
                               image_size=16, seed=0)
    packed = pack.pack_shard(shard, 16)
    ds, ref = PackedBatches(packed, "train"), PackedBatches(packed, "train")
    sampler = EpochSampler(len(ds), 8, seed=0, rank=0, total=3 * len(ds))
    source = DevicePrefetcher(make_loader(ds, sampler, workers, pin_memory=True, ring=True),
                              torch.device("cuda"))
    assert ds.ring is not None and ds.ring.pinned
    for i, _ in enumerate(source):   # an epoch left after 3 batches
        if i == 3:
            break
    sampler.set_epoch(1)
    want = list(sampler)
    held = list(source)   # all of it kept on the GPU: no batch's memory is reused
    torch.cuda.synchronize()
    assert len(held) == len(want) == len(sampler)
    for (x, y), idx in zip(held, want):
        wx, wy = ref[idx]
        assert x.device.type == "cuda" and torch.equal(x.cpu(), wx) and torch.equal(y.cpu(), wy)
    assert source.sampler is sampler


# ---------------------------------------------------------------- worker.train options on GPU

OPTIONS = {
    "amp": ["--amp"],
    "channels-last": ["--channels-last"],
    "amp+channels-last": ["--amp", "--channels-last"],
    # LeNet has no BatchNorm: ResNet-18 at 32 px does (converted on 2+ ranks)
    "sync-bn": ["--sync-bn", "--model", "resnet18"],
    "fp16-gradients": ["--grad-compression", "fp16"],
    "terngrad": ["--grad-compression", "terngrad"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_trains_the_demo_to_target_on_gpu(name: str, torchrun: Torchrun,
                                                 demo: dict[int, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    log = train(torchrun, RANKS, [*DEMO, "--epochs", "30", "--dist-backend", "nccl",
                                  *OPTIONS[name]], demo[RANKS], out)
    assert f"{RANKS} process(es), backend nccl" in log
    assert "has no effect on CPU" not in log
    assert float(metrics(out)[-1]["val_acc"]) >= TARGET, metrics(out)[-1]


@pytest.mark.slow
def test_checkpoint_moves_between_cpu_and_gpu(torchrun: Torchrun,
                                              demo: dict[int, Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    out, args = tmp_path / "out", [*DEMO[:-4], "--checkpoint-every", "1"]  # no early stop
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # first on the CPU
    log = train(torchrun, 1, [*args, "--epochs", "2", "--dist-backend", "gloo"], demo[1], out)
    assert "backend gloo" in log
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # CPU checkpoint -> GPU
    log = train(torchrun, 1, [*args, "--epochs", "4", "--resume", "--dist-backend", "nccl"],
                demo[1], out)
    assert "backend nccl" in log and "resumed from the checkpoint of epoch 2" in log
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPU checkpoint -> CPU
    log = train(torchrun, 1, [*args, "--epochs", "5", "--resume"], demo[1], out)
    assert "backend none" in log and "resumed from the checkpoint of epoch 4" in log
    rows = metrics(out)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4, 5]
    assert float(rows[-1]["val_acc"]) > float(rows[0]["val_acc"])


# ---------------------------------------------------------------- 2 ranks, NCCL, spawned


def _spawn(fn: Callable[..., None], world: int) -> None:
    """Run fn(rank, world, port) in ``world`` spawned processes; fail on any error or hang."""
    spawn_ranks(fn, world, SPAWN_TIMEOUT_S)


def _init_nccl(rank: int, world: int, port: int) -> torch.device:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    return device


def _gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 4, 3), nn.BatchNorm2d(4))


def _syncbn_worker(rank: int, world: int, port: int) -> None:
    device = _init_nccl(rank, world, port)
    try:
        torch.manual_seed(0)
        ref = _bn_net().to(device)
        ddp = nn.parallel.DistributedDataParallel(
            nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref)), device_ids=[rank])
        whole = torch.randn(8 * world, 3, 10, 10,
                            generator=torch.Generator().manual_seed(1)).to(device)
        mine = whole[8 * rank:8 * (rank + 1)]
        out, want = ddp(mine), ref(whole)  # ref: one process, the concatenated batch
        torch.testing.assert_close(out, want[8 * rank:8 * (rank + 1)], rtol=1e-4, atol=1e-5)
        out.square().mean().backward()  # DDP averages: the mean over the whole batch
        want.square().mean().backward()
        for (name, p), q in zip(ddp.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
        for (name, b), c in zip(ddp.module.named_buffers(), ref.buffers()):
            assert b.device == device
            if b.is_floating_point():  # running mean and variance
                torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)
            else:  # batches tracked
                assert torch.equal(b, c), name
    finally:
        dist.destroy_process_group()


@two_gpus
def test_syncbn_on_two_ranks_equals_one_process_on_the_whole_batch() -> None:
    _spawn(_syncbn_worker, 2)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(17, 39), nn.ReLU(), nn.Linear(39, 29), nn.ReLU(),
                         nn.Linear(29, 5))


LOGITS = {"4.weight", "4.bias"}


def _check_records(state: C.TernGradState, device: torch.device) -> None:
    assert state.records, "the TernGrad hook recorded no bucket"
    for index in sorted(state.records):  # the same order on every rank: collectives inside
        rec = state.records[index]
        for t in (rec.local_scalers, rec.shared_scalers, rec.local_decoded, rec.result):
            assert t.device == device
        # result = mean of every rank's decoded ternaries; the scaler = max over ranks
        torch.testing.assert_close(rec.result, _gather(rec.local_decoded).mean(0), rtol=1e-5,
                                   atol=1e-7)
        assert torch.equal(rec.shared_scalers, _gather(rec.local_scalers).max(0).values)


def _terngrad_worker(rank: int, world: int, port: int) -> None:
    device = _init_nccl(rank, world, port)
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_mlp().to(device), device_ids=[rank],
                                                  bucket_cap_mb=0.004)
        stats = C.install_comm_hook(ddp, "terngrad", size_to_binarize=64, logits_param_names=LOGITS)
        stats.hook_state.record = True
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(8, 17, generator=gen) * (1 + rank)
        y = torch.randint(0, 5, (8,), generator=gen)
        nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        _check_records(stats.hook_state, device)
        for name, p in ddp.module.named_parameters():
            same = torch.equal(_gather(p.grad).min(0).values, p.grad)
            assert same, f"{name} differs across ranks"
            if name not in LOGITS and p.numel() >= 64:
                assert p.grad.unique().numel() <= 2 * world + 1, name
        assert stats.bytes_sent > 0
        _check_hook_makes_no_host_sync(ddp, device, rank)
    finally:
        dist.destroy_process_group()


class _Bucket:
    """What the hook reads of DDP's GradBucket."""

    def __init__(self, buf: torch.Tensor, params: list[nn.Parameter]) -> None:
        self.buf, self.params = buf, params

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[nn.Parameter]:
        return self.params

    def index(self) -> int:
        return 0


def _check_hook_makes_no_host_sync(ddp: DDP, device: torch.device, rank: int) -> None:
    """The whole TernGrad hook (scalers' all_reduce, encode, all_gather, decode) on one
    bucket, with any synchronising CUDA call an error (after a first call that builds the
    lookup table and the generator)."""
    state = C._terngrad_state(ddp, C.CommStats("terngrad"), None, 2.5, 64, False, LOGITS, 0)
    params = list(ddp.module.parameters())
    flat = torch.cat([torch.randn(p.numel(), device=device) * (1 + rank) for p in params])
    for mode in ("default", "error"):
        buf = flat.clone()
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode(mode)
        try:
            out = C._terngrad_hook(state, _Bucket(buf, params)).wait()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.device == device and out.data_ptr() == buf.data_ptr()
        assert not torch.equal(out, flat), "the hook did not write the averaged bucket"


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=two_gpus)])
def test_terngrad_hook_over_nccl_all_gather(world: int) -> None:
    _spawn(_terngrad_worker, world)
