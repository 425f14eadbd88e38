"""The web page in a real browser: headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) against `eogp serve` running as its own process on 127.0.0.1.

It types a query, sees ranked results, applies a filter, reads an error shown on the page, and opens
an explanation. A screenshot is saved in the test's tmp dir (set EOGP_SCREENSHOT=path to copy it).
Without the browser the test skips with the command that installs it; under CI=true it fails.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "sudo apt-get install -y chromium chromium-driver"
#: This machine's network is closed: nothing in the background may try to reach it.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1440,900",
)
WAIT_S = 60  # upper bounds on waiting for the page, never asserted as timings


def _missing_browser() -> str | None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    return f"missing {', '.join(missing)}; install with: {INSTALL}" if missing else None


@pytest.fixture(scope="module")
def browser():
    why = _missing_browser()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the browser test must run in CI: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="eogp-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + (f"--user-data-dir={profile}",):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(index_dir, tmp_path_factory):
    """`eogp serve` as a real uvicorn process on loopback; yields its base URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "eogp_index.cli", "serve", str(index_dir), "--port", str(port), "--device", "cpu"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"eogp serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
    # Structured logs: one JSON object per request, with its latency.
    assert '"event": "request"' in log.read_text() and '"latency_ms"' in log.read_text()


def _wait(driver, condition, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, message=f"waiting for {what}")


def _search(driver, query: str, where: str = "", k: int = 4):
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "query-text")
    box.clear()
    box.send_keys(query)
    driver.find_element(By.ID, "where").clear()
    if where:
        driver.find_element(By.ID, "where").send_keys(where)
    k_input = driver.find_element(By.ID, "k")
    k_input.clear()
    k_input.send_keys(str(k))
    before = driver.find_element(By.ID, "status").text
    driver.find_element(By.ID, "search").click()
    _wait(
        driver,
        lambda d: (
            d.find_element(By.ID, "status").text not in ("", "searching…", before)
            or d.find_element(By.ID, "error").is_displayed()
        ),
        "the answer",
    )


def test_the_page_queries_filters_and_explains(browser, server, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(server + "/")
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#columns .chip"), "the column list")
    columns = [
        chip.get_attribute("title").split(":")[0] for chip in browser.find_elements(By.CSS_SELECTOR, "#columns .chip")
    ]
    assert "kind" in columns and "n" in columns and "40 documents" in browser.find_element(By.ID, "index-info").text

    _search(browser, "t1 t2 t3 t4 t5")
    hits = browser.find_elements(By.CSS_SELECTOR, "li.hit")
    assert len(hits) == 8  # k = 4 per direction, both directions
    assert [h.text for h in browser.find_elements(By.CSS_SELECTOR, "h2.side")][0].startswith("Helps")
    assert all(
        h.find_elements(By.CSS_SELECTOR, ".bar .fill") and h.find_elements(By.CSS_SELECTOR, ".doc") for h in hits
    )
    # The index has a rescoring tier: each hit shows its rescored score and its one-bit score.
    assert all(h.find_element(By.CSS_SELECTOR, ".score-1bit").text.startswith("1-bit ") for h in hits)

    # A filter from the column list: every hit now has kind = 'class'.
    _search(browser, "t1 t2 t3 t4 t5", where="kind = 'class'")
    metas = [h.find_element(By.CSS_SELECTOR, ".meta").text for h in browser.find_elements(By.CSS_SELECTOR, "li.hit")]
    assert 0 < len(metas) <= 8 and all("kind class" in m for m in metas), metas  # a side may be short

    # A bad filter is shown on the page, naming the field and the columns to use.
    _search(browser, "t1 t2 t3 t4 t5", where="kynd = 'class'")
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and "where" in error.text and "kind" in error.text
    assert "invalid" in browser.find_element(By.ID, "where").get_attribute("class")

    # Back to a good filter, then open the explanation of the top hit.
    _search(browser, "t1 t2 t3 t4 t5", where="kind = 'class'")
    assert not browser.find_element(By.ID, "error").is_displayed()
    first = browser.find_elements(By.CSS_SELECTOR, "li.hit")[0]
    first.click()
    _wait(
        browser,
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#detail .tokens .tok")
            or d.find_elements(By.CSS_SELECTOR, "#detail .error")
        ),
        "the explanation",
    )
    detail = browser.find_element(By.ID, "detail")
    assert first.get_attribute("data-id") in detail.text
    assert len(detail.find_elements(By.CSS_SELECTOR, ".module-bar")) == 8
    assert not detail.find_elements(By.CSS_SELECTOR, ".error"), detail.text
    query_tokens = detail.find_elements(By.CSS_SELECTOR, ".tokens")[1].find_elements(By.CSS_SELECTOR, ".tok")
    assert [t.text for t in query_tokens] == "t1 t2 t3 t4 t5".split()
    assert "rescored score" in detail.text and "1-bit score" in detail.text  # both scores, the ranked one first

    shot = tmp_path / "serve.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("EOGP_SCREENSHOT"):
        shutil.copyfile(shot, Path(os.environ["EOGP_SCREENSHOT"]))


def test_the_readme_curl_line_works_as_written(server):
    """The README's example, run by curl against the real server: its body is read as JSON."""
    import json
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("curl -s localhost:8000/v1/query")]
    # The README's text and filter are its demo index's; this index has words t1 … t63 and kinds.
    line = line.replace("localhost:8000", server.removeprefix("http://"))
    line = re.sub(r'"text": "[^"]*"', '"text": "t1 t2 t3 t4 t5"', line)
    for sends_form in (line, line.replace(" -H 'Content-Type: application/json'", "")):
        printed = subprocess.run(["bash", "-c", sends_form], capture_output=True, text=True, timeout=WAIT_S)
        answer = json.loads(printed.stdout)
        assert "error" not in answer, (sends_form, answer)
        assert answer["results"] and all(r["kind"] == "function" for r in answer["results"])


def _explain_first_hit(driver):
    from selenium.webdriver.common.by import By

    first = driver.find_elements(By.CSS_SELECTOR, "li.hit")[0]
    first.click()
    _wait(
        driver,
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#detail .tokens .tok")
            or d.find_elements(By.CSS_SELECTOR, "#detail .error")
        ),
        "the explanation",
    )
    return first.get_attribute("data-id")


def test_each_search_clears_the_last_answer_and_an_empty_side_says_so(browser, server):
    import json

    from selenium.webdriver.common.by import By

    browser.get(server + "/")
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#columns .chip"), "the column list")
    _search(browser, "t1 t2 t3 t4 t5")
    explained = _explain_first_hit(browser)
    assert explained in browser.find_element(By.ID, "detail").text

    # A new search: the explanation of the old hit goes with the old answer.
    _search(browser, "t9 t8 t7", where="kind = 'module'")
    detail = browser.find_element(By.ID, "detail")
    assert detail.find_elements(By.CSS_SELECTOR, ".placeholder") and not detail.find_elements(By.CSS_SELECTOR, "h2")
    assert browser.find_elements(By.CSS_SELECTOR, "li.hit")

    # A failed search: the error alone, without the previous query's hits under it.
    _explain_first_hit(browser)
    _search(browser, "t9 t8 t7", where="kind = 'module' garbage")
    assert browser.find_element(By.ID, "error").is_displayed()
    assert "column 17" in browser.find_element(By.ID, "error").text
    assert browser.find_elements(By.CSS_SELECTOR, "li.hit") == []
    assert browser.find_element(By.ID, "detail").find_elements(By.CSS_SELECTOR, ".placeholder")

    # The document that helps the query most, alone under a filter: nothing hurts the query.
    request = urllib.request.Request(
        f"{server}/v1/query",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"text": "t1 t2 t3 t4 t5", "k": 1, "direction": "positive"}).encode(),
    )
    best = json.loads(urllib.request.urlopen(request, timeout=WAIT_S).read())["results"][0]["id"]
    _search(browser, "t1 t2 t3 t4 t5", where=f"id = '{best}'")
    assert [h.text.split(":")[0] for h in browser.find_elements(By.CSS_SELECTOR, "h2.side")] == ["Helps", "Hurts"]
    assert [h.get_attribute("data-id") for h in browser.find_elements(By.CSS_SELECTOR, "li.hit")] == [best]
    assert browser.find_element(By.CSS_SELECTOR, "#results p.none").text == "No documents hurt this query."


def test_the_page_downloads_a_selection(browser, server, served_index, tmp_path):
    import json

    from selenium.webdriver.common.by import By

    from eogp_index.config import SelectOptions
    from eogp_index.search.question import Question
    from eogp_index.search.select import select_documents

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    browser.get(server + "/")
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#columns .chip"), "the column list")
    browser.find_element(By.ID, "query-text").send_keys("t1 t2 t3 t4 t5")
    browser.find_element(By.ID, "where").send_keys("kind = 'class'")
    top = browser.find_element(By.ID, "select-top")
    top.clear()
    top.send_keys("5")
    browser.find_element(By.ID, "download-selection").click()
    saved = downloads / "selection.jsonl"
    _wait(browser, lambda d: saved.exists() and not list(downloads.glob("*.crdownload")), "the downloaded file")
    assert "5 documents" in browser.find_element(By.ID, "status").text
    records = [json.loads(line) for line in saved.read_text().splitlines()]
    targets = Question(queries=("t1 t2 t3 t4 t5",), where="kind = 'class'")
    expected = select_documents(served_index, targets, SelectOptions(top="5"))
    ids = served_index.store.take_rows(expected.rowaddr.tolist(), ["id"]).column("id").to_pylist()
    assert sorted(r["id"] for r in records) == sorted(ids)
    assert all(r["kind"] == "class" and "text" in r and "score" in r for r in records)

    # A bad share is shown on the page, on the field it came from.
    top.clear()
    top.send_keys("250%")
    browser.find_element(By.ID, "download-selection").click()
    _wait(browser, lambda d: d.find_element(By.ID, "error").is_displayed(), "the error")
    assert "--top" in browser.find_element(By.ID, "error").text
    assert "invalid" in top.get_attribute("class")


def test_a_behaviour_query_rolls_up_by_kind_and_a_click_filters_to_a_group(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(server + "/")
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#group-by option")) > 1, "the group-by columns")
    browser.find_element(By.CSS_SELECTOR, ".tab[data-mode='behaviour']").click()
    box = browser.find_element(By.ID, "behaviour-text")
    assert box.is_displayed() and not browser.find_element(By.ID, "query-text").is_displayed()
    box.send_keys("t1 t2 t3 t4 t5\nt7 t8 t9 t10\nt11 t12 t13")
    Select(browser.find_element(By.ID, "aggregate")).select_by_value("mean")
    Select(browser.find_element(By.ID, "group-by")).select_by_value("kind")
    k_input = browser.find_element(By.ID, "k")
    k_input.clear()
    k_input.send_keys("3")
    browser.find_element(By.ID, "search").click()
    _wait(
        browser,
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#groups .group-bar") or d.find_element(By.ID, "error").is_displayed()
        ),
        "the group chart",
    )
    assert not browser.find_element(By.ID, "error").is_displayed(), browser.find_element(By.ID, "error").text
    bars = browser.find_elements(By.CSS_SELECTOR, "#groups .group-bar")
    assert sorted(b.get_attribute("data-group") for b in bars) == ["class", "function", "module"]
    assert all(b.find_elements(By.CSS_SELECTOR, ".axis .fill") for b in bars)
    assert len(browser.find_elements(By.CSS_SELECTOR, "li.hit")) == 6  # the behaviour's hits, k = 3 per side

    # Clicking a group makes it the filter: its hits only, and the chart gives way to them.
    next(b for b in bars if b.get_attribute("data-group") == "class").click()
    _wait(
        browser,
        lambda d: (
            not d.find_elements(By.CSS_SELECTOR, "#groups .group-bar")
            and d.find_element(By.ID, "status").text not in ("", "searching…")
        ),
        "the group's hits",
    )
    assert browser.find_element(By.ID, "where").get_attribute("value") == "kind = 'class'"
    metas = [h.find_element(By.CSS_SELECTOR, ".meta").text for h in browser.find_elements(By.CSS_SELECTOR, "li.hit")]
    # Up to k = 3 per side: a side holds only rows of its sign.
    assert 0 < len(metas) <= 6 and all("kind class" in m for m in metas), metas

    # A column with a group per document: the chart draws both ends of the ranking and counts the rest.
    browser.find_element(By.ID, "where").clear()
    Select(browser.find_element(By.ID, "group-by")).select_by_value("id")
    browser.find_element(By.ID, "search").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#groups .group-bar"), "the per-document chart")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#groups .group-bar")) == 25
    assert "15 more groups" in browser.find_element(By.ID, "groups").text
