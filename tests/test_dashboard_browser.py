"""The dashboard in a real browser: headless Chromium (the distribution's `chromium` and
`chromium-driver`, `make system-deps`) driven by Selenium, against a job on the fake
cluster whose ranks print `<script>alert(1)</script>` and run until stopped. The page
without the token is refused; with it, every rank and a curve appear, the `<script>` is
shown as text and runs nothing, and the stop button asks first (dismissed: nothing is
stopped) and then stops the job on every host."""
from __future__ import annotations

import http.client
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import api
from orchestrator.dashboard import page
from test_controller_fake import inventory
from test_dashboard_units import SCRIPT, Running

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)),
                       reason="needs chromium and chromium-driver (apt-get install chromium "
                              "chromium-driver, or `make system-deps`)"),
]
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage")
METRICS = "epoch,time_s,train_loss,train_acc,val_loss,val_acc,images_per_s,lr,grad_bytes\n" + "".join(
    f"{e},{e * 10},{2.0 / (e + 1):.3f},{0.5 + e / 20:.3f},{2.1 / (e + 1):.3f},{0.5 + e / 25:.3f},900,0.1,1000\n"
    for e in range(5))


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="orch-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    pid = driver.service.process.pid
    try:
        yield driver
    finally:
        driver.quit()
        gone(pid)
        shutil.rmtree(profile, ignore_errors=True)


def gone(pid: int) -> None:
    """chromedriver (and the browser under it) ended: its pid no longer runs."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"chromedriver {pid} still runs")


def until(driver: Any, what: Any, timeout: float = 30) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(what)


def test_the_page_in_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, browser: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    job = Running(monkeypatch)
    path = inventory(tmp_path)
    api.up(path)
    (tmp_path / "outputs" / "fk").mkdir(parents=True)
    (tmp_path / "outputs" / "fk" / "metrics.csv").write_text(METRICS)
    opened = page.open_for_job(path)
    try:
        bare = opened.url.split("?")[0]
        conn = http.client.HTTPConnection("127.0.0.1", opened.server.port, timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 403
        conn.close()
        browser.get(bare)
        assert "forbidden" in browser.find_element(By.TAG_NAME, "body").text

        browser.get(opened.url)
        rows = until(browser, lambda d: len(r := d.find_elements(By.CSS_SELECTOR, "#rank-rows tr")) == 6 and r)
        assert [r.find_elements(By.TAG_NAME, "td")[1].text for r in rows] == \
            ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
        until(browser, lambda d: d.find_element(By.ID, "rank-rows").text.count("running") == 6)
        # a curve: the chart of train_loss from rank 0's metrics.csv, drawn by uPlot
        until(browser, lambda d: "train_loss" in [h.text for h in d.find_elements(By.CSS_SELECTOR, "#curve-charts h3")])
        assert browser.find_elements(By.CSS_SELECTOR, "#curve-charts .uplot canvas")

        # rank 2's log: the <script> it printed, as text; nothing ran
        Select(browser.find_element(By.ID, "log-rank")).select_by_value("2")
        view = browser.find_element(By.ID, "log-view")
        until(browser, lambda d: SCRIPT.decode() in view.text)
        assert browser.execute_script("return document.querySelectorAll('main script').length") == 0
        with pytest.raises(NoAlertPresentException):
            _ = browser.switch_to.alert.text   # alert(1) never ran: there is no alert
        search = browser.find_element(By.ID, "log-search")
        search.send_keys("rank 2")
        until(browser, lambda d: view.text == "rank 2 up")
        search.clear()

        # the stop asks first: dismissed, nothing stopped; accepted, every host stopped
        browser.find_element(By.ID, "stop").click()
        until(browser, lambda d: d.switch_to.alert).dismiss()
        time.sleep(0.5)
        assert not job.fake.requests("stop")
        browser.find_element(By.ID, "stop").click()
        confirm = until(browser, lambda d: d.switch_to.alert)
        assert "Stop job fk on every host?" in confirm.text
        confirm.accept()
        until(browser, lambda d: "stopped on 3 hosts" in d.find_element(By.ID, "notes").text)
        assert {m["t"] for m in job.fake.requests("stop")} == {"stop"} and len(job.fake.requests("stop")) >= 3
        until(browser, lambda d: d.find_element(By.ID, "rank-rows").text.count("stopped") == 6)
        assert browser.find_element(By.ID, "stop").get_attribute("disabled")
        refused = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
        assert not refused, "the page breaks its own CSP"

        # the finished run saved as one file, opened from disk: the same page, offline
        saved = tmp_path / "saved.html"
        conn = http.client.HTTPConnection("127.0.0.1", opened.server.port, timeout=30)
        conn.request("GET", "/save", headers={"X-Orch-Token": opened.server.token})
        saved.write_bytes(conn.getresponse().read())
        conn.close()
    finally:
        opened.close()
    browser.get(saved.as_uri())
    until(browser, lambda d: d.find_element(By.ID, "rank-rows").text.count("stopped") == 6)
    assert "train_loss" in [h.text for h in browser.find_elements(By.CSS_SELECTOR, "#curve-charts h3")]
    Select(browser.find_element(By.ID, "log-rank")).select_by_value("2")
    until(browser, lambda d: SCRIPT.decode() in d.find_element(By.ID, "log-view").text)
    assert browser.execute_script("return document.querySelectorAll('main script').length") == 0
    assert not [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
