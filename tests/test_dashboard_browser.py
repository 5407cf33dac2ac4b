"""The dashboard in a real browser: headless Chromium (the distribution's `chromium` and
`chromium-driver`, `make system-deps`) driven by Selenium, against a job on the fake
cluster whose ranks print `<script>alert(1)</script>` and run until stopped. The page
without the token is refused; with it, every rank and a curve appear, the `<script>` is
shown as text and runs nothing, and the stop button asks first (dismissed: nothing is
stopped) and then stops the job on every host. Then the same over real SSH (the suite's
sshd hosts): a rank's exit, a printed line and an epoch's curve point reach the page,
and the stop button's stop is verified on the hosts."""
from __future__ import annotations

import http.client
import json
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
from test_dashboard_units import ARRAY, SCRIPT, Running, array_results

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
TRAP = "hostname resolves to 127.0.1.1 (loopback)"
PLAN = {"master_addr": "127.0.0.1", "how": "the inventory's address", "probe": "p", "hosts": [
    *({"host": f"127.0.0.{i}", "interface": "lo", "how": "auto", "address": f"127.0.0.{i}", "found": [TRAP],
       "set": {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}} for i in (1, 2)),
    {"host": SCRIPT.decode(), "interface": None, "how": "one machine", "address": "", "found": [], "set": {}}]}


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


def until(driver: Any, what: Any, timeout: float = 60) -> Any:
    """`what` true within `timeout`; the page redraws its tables every second, so an
    element read between two polls may be gone: read again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=(
        NoSuchElementException, StaleElementReferenceException)).until(what)


def cells(driver: Any, column: int) -> list[str]:
    """One column of the rank table, read at once (the rows are redrawn every poll)."""
    return list(driver.execute_script(
        "var c = arguments[0]; return Array.from(document.querySelectorAll('#rank-rows tr'))"
        ".map(function (r) { return r.children[c].textContent; })", column))


def test_the_page_in_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, browser: Any) -> None:
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    job = Running(monkeypatch)
    path = inventory(tmp_path)
    run_id = api.up(path).run_id
    (tmp_path / "outputs" / "fk").mkdir(parents=True)
    (tmp_path / "outputs" / "fk" / "metrics.csv").write_text(METRICS)
    (tmp_path / ".orch" / "fk" / "network.json").write_text(json.dumps(dict(PLAN, run_id=run_id)))
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
        until(browser, lambda d: len(cells(d, 1)) == 6)
        assert cells(browser, 1) == ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2 + ["127.0.0.3"] * 2
        until(browser, lambda d: d.find_element(By.ID, "rank-rows").text.count("running") == 6)
        # a curve: the chart of train_loss from rank 0's metrics.csv, drawn by uPlot
        until(browser, lambda d: "train_loss" in [h.text for h in d.find_elements(By.CSS_SELECTOR, "#curve-charts h3")])
        assert browser.find_elements(By.CSS_SELECTOR, "#curve-charts .uplot canvas")

        # the network plan: the master, then a row per group of identical hosts, as text
        assert browser.find_element(By.ID, "network-master").text == "127.0.0.1"
        rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
                for tr in browser.find_elements(By.CSS_SELECTOR, "#network-rows tr")]
        assert rows == [["127.0.0.[1-2]", "lo", "127.0.0.[1-2]", "auto", TRAP,
                         "GLOO_SOCKET_IFNAME=lo\nNCCL_SOCKET_IFNAME=lo"],
                        [SCRIPT.decode(), "left to torch", "", "one machine", "", "nothing"]]
        assert not browser.find_elements(By.CSS_SELECTOR, "#network-rows script")
        assert not browser.find_element(By.ID, "curve-task-row").is_displayed()   # not an array

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
        # the ranks' exits come before the run's end, which disables the button
        until(browser, lambda d: d.find_element(By.ID, "stop").get_attribute("disabled"))
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


def test_a_rank_picked_while_the_poll_asks_shows_each_line_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, browser: Any) -> None:
    """Picking a rank polls its log at once, beside the page's own poll: with the first
    answer slow, both are in flight from the same cursor, and the later one's lines were
    shown a second time (CI: the search then never matched "rank 2 up" alone)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from orchestrator.dashboard.board import Board
    Running(monkeypatch)
    path = inventory(tmp_path)
    api.up(path)
    log = Board.log

    def slow(self: Board, rank: int, after: int = 0, **kw: Any) -> Any:
        if rank == 2 and after == 0:
            time.sleep(1.5)   # longer than the page's poll period: the next poll asks too
        return log(self, rank, after, **kw)
    monkeypatch.setattr(Board, "log", slow)
    opened = page.open_for_job(path)
    try:
        browser.get(opened.url)
        until(browser, lambda d: len(cells(d, 1)) == 6)
        Select(browser.find_element(By.ID, "log-rank")).select_by_value("2")
        until(browser, lambda d: "rank 2 up" in d.find_element(By.ID, "log-view").text)
        time.sleep(3.5)   # every poll in flight has answered
        text = browser.find_element(By.ID, "log-view").text
        assert text.count("rank 2 up") == 1, text
    finally:
        opened.close()


def test_a_job_arrays_curves_per_task_in_chromium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  browser: Any) -> None:
    """A job array: its tasks and groups over folds; every task's curve on one chart, one
    task's alone when it is picked (in the list, or by clicking its row)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    array_results(tmp_path, monkeypatch)
    for t in (1, 3):
        (tmp_path / "outputs" / "arr" / f"task-{t}").mkdir(parents=True)
        (tmp_path / "outputs" / "arr" / f"task-{t}" / "metrics.csv").write_text(METRICS)
    opened = page.open_for_job(inventory(tmp_path, ARRAY))
    try:
        browser.get(opened.url)
        until(browser, lambda d: series(d, "curve:train_loss") == 2)
        assert browser.find_element(By.ID, "curve-task-row").is_displayed()
        assert len(browser.find_elements(By.CSS_SELECTOR, "#task-rows tr")) == 4
        assert len(browser.find_elements(By.CSS_SELECTOR, "#group-rows tr")) == 2
        choice = Select(browser.find_element(By.ID, "curve-task"))
        assert [o.text for o in choice.options] == ["every task", "task 1 (--model m0 --fold 1)",
                                                    "task 3 (--model m1 --fold 1)"]
        choice.select_by_value("3")
        until(browser, lambda d: series(d, "curve:train_loss") == 1)
        assert "task 3" in browser.find_element(By.CSS_SELECTOR, '[data-chart="curve:train_loss"]').text
        browser.find_elements(By.CSS_SELECTOR, "#task-rows tr")[1].click()
        picked = lambda d: Select(d.find_element(By.ID, "curve-task")).first_selected_option.text  # noqa: E731
        until(browser, lambda d: picked(d).startswith("task 1"))
        assert "task 1" in browser.find_element(By.CSS_SELECTOR, '[data-chart="curve:train_loss"]').text
        choice.select_by_value("")
        until(browser, lambda d: series(d, "curve:train_loss") == 2)
    finally:
        opened.close()


def series(driver: Any, key: str) -> int:
    got = driver.execute_script(
        "var c = document.querySelector('[data-chart=\"' + arguments[0] + '\"]'); "
        "return c ? parseInt(c.dataset.series, 10) : 0", key)
    return int(got or 0)


# ---------------------------------------------------------------- over real SSH

E2E_JOB = """\
import os, time
out, rank = os.environ["ORCH_OUTPUT_DIR"], int(os.environ["RANK"])
os.makedirs(out, exist_ok=True)

def row(epoch):
    if rank == 0:
        path = os.path.join(out, "metrics.csv")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            f.write(("epoch,train_loss\\n" if new else "") + "%d,%g\\n" % (epoch, 1.0 / epoch))

print("<script>alert(1)</script>", flush=True)
if rank == 1:   # more than the page keeps: the download has them all
    print("".join("bulk line %d\\n" % i for i in range(6000)), end="", flush=True)
row(1)
print("epoch 1 written", flush=True)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
row(2)
print("epoch 2 written", flush=True)
if rank == 0:
    time.sleep(600)   # runs until the page's stop
"""


def points(driver: Any, key: str) -> int:
    got = driver.execute_script(
        "var c = document.querySelector('[data-chart=\"' + arguments[0] + '\"]'); "
        "return c ? parseInt(c.dataset.points, 10) : 0", key)
    return int(got or 0)


@pytest.mark.ssh
def test_a_job_on_sshd_hosts_in_chromium(sshd_cluster: Any, tmp_path: Path, jobs: Any,
                                         browser: Any) -> None:
    """`orch up --detach`, then the page: both ranks running; a rank's exit, a line it
    prints and an epoch's curve point appear; the `<script>` is text; the stop button
    stops the job on the hosts. The delays are printed (the 2 s the issue aims at is
    not asserted: this machine's load varies)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from helpers import assert_nothing_left, job_dir, job_pids, write_job
    hosts, name = sshd_cluster.hosts[:2], "e2e-dash"
    write_job(tmp_path, E2E_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    api.up(inv)
    opened = page.open_for_job(inv)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", opened.server.port, timeout=30)
        conn.request("GET", "/")
        assert conn.getresponse().status == 403
        conn.close()
        browser.get(opened.url)
        table = browser.find_element(By.ID, "rank-rows")
        until(browser, lambda d: table.text.count("running") == 2, 120)
        until(browser, lambda d: points(d, "curve:train_loss") == 1, 60)
        Select(browser.find_element(By.ID, "log-rank")).select_by_value("0")
        view = browser.find_element(By.ID, "log-view")
        until(browser, lambda d: "epoch 1 written" in view.text, 60)
        assert SCRIPT.decode() in view.text
        assert browser.execute_script("return document.querySelectorAll('main script').length") == 0

        t0 = time.monotonic()
        for h in hosts:
            (job_dir(h, name) / "output" / "go").touch()
        until(browser, lambda d: "epoch 2 written" in view.text, 60)
        line_s = time.monotonic() - t0
        until(browser, lambda d: "exited 0" in d.find_element(By.CSS_SELECTOR, '#rank-rows tr[data-rank="1"]').text, 60)
        exit_s = time.monotonic() - t0
        until(browser, lambda d: points(d, "curve:train_loss") == 2, 60)
        curve_s = time.monotonic() - t0
        # rank 1's whole log, read on its host: every line, past the page's 5,000
        conn = http.client.HTTPConnection("127.0.0.1", opened.server.port, timeout=60)
        conn.request("GET", "/api/log.txt?rank=1", headers={"X-Orch-Token": opened.server.token})
        whole = conn.getresponse().read().decode().splitlines()
        conn.close()
        assert whole[0] == SCRIPT.decode() and whole[-1] == "epoch 2 written"
        assert [t for t in whole if t.startswith("bulk line")] == [f"bulk line {i}" for i in range(6000)]
        print(f"\ndashboard over sshd: line {line_s:.2f} s, rank 1's exit {exit_s:.2f} s, "
              f"curve point {curve_s:.2f} s after the epoch's go")

        browser.find_element(By.ID, "stop").click()
        until(browser, lambda d: d.switch_to.alert).accept()
        until(browser, lambda d: "stopped on 2 hosts" in d.find_element(By.ID, "notes").text, 120)
        until(browser, lambda d: not any(job_pids(hosts, name).values()), 60)
        until(browser, lambda d: "running" not in table.text, 60)
    finally:
        opened.close()
    assert_nothing_left(hosts, name)
