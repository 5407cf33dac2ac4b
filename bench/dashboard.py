"""The dashboard's costs (issue 35's measures), on a Board fed directly with events (no
hosts: what is measured is the page's side, not the follow's):

- the page's size (every file it loads) and the state document's for N ranks;
- the controller's CPU for the board and its server: 64 hosts x 8 ranks printing
  LINES_PER_S lines each, the page polling every second (process CPU time of this
  process, which does nothing else, over the wall time);
- time to first paint and to every rank's row drawn, for a 1,000-rank job, in headless
  Chromium;
- the page's update delay: a rank's state change made at t0, seen in the page's table.

    .venv/bin/python bench/dashboard.py
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

from orchestrator.api import RankExited, RankLine, RankStarted  # noqa: E402
from orchestrator.config.inventory import load  # noqa: E402
from orchestrator.dashboard import server  # noqa: E402
from orchestrator.dashboard.board import Board  # noqa: E402

LINES_PER_S = 10


def inventory(folder: Path, hosts: int, procs: int) -> Board:
    lines = [f"  - {{address: 10.0.{i // 250}.{i % 250 + 1}, procs: {procs}}}" for i in range(hosts)]
    path = folder / "cluster.yaml"
    path.write_text("name: bench\nhosts:\n" + "\n".join(lines) + "\ncode: {paths: [job.py]}\n"
                    "job: {entrypoint: job.py}\n")
    (folder / "job.py").write_text("")
    return Board(load(path))


def get(dash: server.Dashboard, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=30)
    conn.request("GET", path, headers={"X-Orch-Token": dash.token})
    body = conn.getresponse().read()
    conn.close()
    return body


def page_size() -> int:
    return sum(len(server.static(n)) for n in server.STATIC)


def cpu(board: Board, seconds: float = 10.0) -> dict[str, float]:
    """The board fed 512 ranks' lines at LINES_PER_S each, a poll of the state and the
    shown rank's log every second: this process's CPU over the wall time."""
    dash = server.Dashboard(board, None).start()
    ranks = sorted(board.ranks.values(), key=lambda r: r.rank)
    now = time.time()
    board.many([RankStarted(now, r.rank, r.host, 1000 + r.rank) for r in ranks])
    stop = threading.Event()

    def feed() -> None:
        n = 0
        while not stop.is_set():
            t = time.time()
            board.many([RankLine(t, r.rank, r.host, "out", b"epoch 1 step %d loss 0.1234 images/s 812.3" % n)
                        for r in ranks])
            n += 1
            stop.wait(1.0 / LINES_PER_S)

    def poll() -> None:
        after = 0
        while not stop.is_set():
            state = json.loads(get(dash, "/api/state"))
            after = json.loads(get(dash, f"/api/log?rank=0&after={after}"))["next"]
            del state
            stop.wait(1.0)
    threads = [threading.Thread(target=feed), threading.Thread(target=poll)]
    c0, w0 = time.process_time(), time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    c1, w1 = time.process_time(), time.monotonic()
    state = get(dash, "/api/state")
    dash.close()
    return {"cpu_percent_of_one_core": round(100 * (c1 - c0) / (w1 - w0), 1),
            "lines_per_s": len(ranks) * LINES_PER_S, "state_bytes": len(state)}


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path="/usr/bin/chromedriver"))


def first_paint(board: Board, driver: Any) -> dict[str, float]:
    """A 1,000-rank job's page: first contentful paint, and every rank's row drawn
    (milliseconds from the navigation's start)."""
    ranks = sorted(board.ranks.values(), key=lambda r: r.rank)
    board.many([RankLine(time.time(), r.rank, r.host, "out", b"step 10 loss 0.25") for r in ranks])
    dash = server.Dashboard(board, None).start()
    try:
        driver.get(dash.url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = driver.execute_script(
                "return document.querySelectorAll('#rank-rows tr').length === arguments[0] "
                "? performance.now() : null", len(ranks))
            if done:
                break
            time.sleep(0.01)
        fcp = driver.execute_script(
            "var e = performance.getEntriesByName('first-contentful-paint')[0]; return e ? e.startTime : null")
        return {"ranks": len(ranks), "first_contentful_paint_ms": round(fcp or -1),
                "all_rows_ms_at_most": round(done or -1)}
    finally:
        dash.close()


def update_delay(board: Board, driver: Any, samples: int = 5) -> dict[str, float]:
    """A rank's exit applied to the board at t0; the seconds until the page's table says it."""
    dash = server.Dashboard(board, None).start()
    delays = []
    try:
        driver.get(dash.url)
        time.sleep(2)
        for rank in range(samples):
            row = board.ranks[rank]
            t0 = time.monotonic()
            board(RankExited(time.time(), rank, row.host, 0, None, 1.0))
            while time.monotonic() - t0 < 30:
                text = driver.execute_script(
                    "var r = document.querySelector('#rank-rows tr[data-rank=\"' + arguments[0] + '\"]'); "
                    "return r ? r.textContent : ''", rank)
                if "exited 0" in text:
                    break
                time.sleep(0.01)
            delays.append(time.monotonic() - t0)
            time.sleep(0.37)   # not in step with the poll
    finally:
        dash.close()
    return {"median_s": round(sorted(delays)[len(delays) // 2], 2), "max_s": round(max(delays), 2)}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp) / "64", Path(tmp) / "1000"
        small.mkdir()
        big.mkdir()
        out: dict[str, Any] = {"loadavg": Path("/proc/loadavg").read_text().split()[:3],
                               "cpus": os.cpu_count(), "page_bytes": page_size()}
        out["cpu_64_hosts_512_ranks"] = cpu(inventory(small, 64, 8))
        driver = browser()
        try:
            out["first_paint"] = first_paint(inventory(big, 125, 8), driver)
            out["update_delay"] = update_delay(inventory(small, 64, 8), driver)
        finally:
            driver.quit()
        out["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
