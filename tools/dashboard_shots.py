"""The dashboard's screenshots in the docs (docs/img/dashboard-*.png): a job on the test
suite's in-process fake cluster (tests/fake_agent.py), its page in headless Chromium,
once while it runs (with a metrics.csv for its curves) and once after rank 3 failed.

    .venv/bin/python tools/dashboard_shots.py docs/img
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests")]

import pytest  # noqa: E402

from fake_agent import FakeCluster  # noqa: E402
from orchestrator import api  # noqa: E402
from orchestrator.dashboard import page  # noqa: E402
from test_controller_fake import inventory  # noqa: E402
from test_dashboard_browser import CHROMIUM, DRIVER, FLAGS, METRICS  # noqa: E402
from test_dashboard_units import Running  # noqa: E402


def browser(profile: str) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}", "--window-size=1280,1500"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))


def shot(driver: Any, inv: str, out: Path, wait_for: str) -> None:
    opened = page.open_for_job(inv)
    try:
        driver.get(opened.url)
        deadline = time.monotonic() + 30
        while wait_for not in driver.page_source and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.5)   # a few polls: the curves and the log drawn
        driver.save_screenshot(str(out))
    finally:
        opened.close()


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        driver = browser(tmp + "/profile")
        try:
            running = Path(tmp) / "running"
            running.mkdir()
            job = Running(mp)
            inv = inventory(running)
            api.up(inv)
            (running / "outputs" / "fk").mkdir(parents=True)
            (running / "outputs" / "fk" / "metrics.csv").write_text(METRICS)
            shot(driver, inv, folder / "dashboard-running.png", "train_loss")
            for chan in job.chans:   # its ranks end
                chan.stopped.set()
            failed = Path(tmp) / "failed"
            failed.mkdir()
            FakeCluster(lambda label, rank, env: 3 if rank == 3 else 0).install(mp)
            inv = inventory(failed)
            api.up(inv)
            shot(driver, inv, folder / "dashboard-failed.png", "Root cause")
        finally:
            driver.quit()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img"))
