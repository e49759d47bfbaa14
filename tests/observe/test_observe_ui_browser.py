"""The live web inspector (issue 26) in a real headless browser: Debian's Chromium driven by Playwright (never
`playwright install`: .ci/run installs the `chromium` package). The page loads against a live store, its overview
matches `stats()`, per-task progress moves while a writer runs, a SQL query returns rows, a hostile query is refused
with the sandbox's error, a wrong token is refused. Screenshots go to the test's directory (and to
$ARROWBUF_UI_SCREENSHOTS when set: docs/img/inspector.png was written that way)."""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf.observe.identity import acting_as
from arrowbuf.observe.ui import Inspector

sync_api = pytest.importorskip("playwright.sync_api")
pytest.importorskip("duckdb")
CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium; .ci/run does)",
                allow_module_level=True)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
pytestmark = pytest.mark.slow

SCHEMA = {"name": "grpo", "fields": {
    "prompt_id": {"dtype": "int64"},
    "reward": {"dtype": "float32", "later": True},
    "done": {"dtype": "bool"},
    "policy_version": {"dtype": "int64"},
}}
TOKEN = "s3cret-token"


def rows(first: int, n: int) -> dict:
    return {"prompt_id": np.arange(first, first + n, dtype=np.int64) // 4, "done": np.ones(n, bool),
            "policy_version": np.zeros(n, np.int64)}


def number(page, selector: str) -> int:
    return int(page.inner_text(selector).replace(",", ""))


def shot(page, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    # the bytes, written here: Playwright writes a `path=` through its event loop's executor, whose thread outlives
    # the test
    path.write_bytes(page.screenshot(full_page=True))
    out = os.environ.get("ARROWBUF_UI_SCREENSHOTS")
    if out:
        os.makedirs(out, exist_ok=True)
        shutil.copy(path, os.path.join(out, f"{name}.png"))


@pytest.fixture
def live():
    store = ab.ExperienceStore(SCHEMA, capacity=5000, tasks=["ref", "train"], seed=0)
    with acting_as("actor-test"):
        ids = store.extend(rows(0, 200))
    store.update(ids, {"reward": np.linspace(0, 1, 200, dtype=np.float32)})
    with acting_as("trainer"):
        store.consume("train", 50)
    inspector = Inspector(store, "127.0.0.1:0", token=TOKEN, interval=0.2)
    try:
        yield store, inspector
    finally:
        inspector.close()
        store.close()


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def test_the_inspector_in_a_real_browser(live, browser, tmp_path):
    store, inspector = live
    # bypass_csp: Playwright's wait_for_function evaluates strings, which the page's Content-Security-Policy forbids
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(inspector.url + "?refresh=250#token=" + TOKEN)
    page.wait_for_function("document.getElementById('size').textContent === '200'", timeout=15_000)

    # the overview matches stats()
    st = store.stats()
    assert number(page, "#size") == st["size"] == 200
    assert number(page, "#capacity") == st["capacity"] == 5000
    assert number(page, "#inserts") == st["inserts"]
    assert page.inner_text("#fill") == f"{100 * st['size'] / st['capacity']:.1f}%"
    assert {page.inner_text(f"#tiers tbody tr:nth-child({i + 1}) td.tier") for i in range(len(st["bytes"]))} \
        == set(st["bytes"])
    assert page.locator("#placement tbody tr").count() >= len(store.schema.fields)
    page.wait_for_selector("#tasks tr[data-task='train']")
    assert number(page, "#tasks tr[data-task='train'] td.delivered") == st["consumed"]["train"] == 50
    assert number(page, "#tasks tr[data-task='train'] td.consumed") == 50
    assert number(page, "#tasks tr[data-task='train'] td.ready") == 150

    # per-task progress moves while a writer runs (and a consumer takes rows for "ref")
    stop = threading.Event()

    def write() -> None:
        i = 200
        with acting_as("actor-test"):
            while not stop.is_set():
                store.extend(rows(i, 20))
                i += 20
                time.sleep(0.05)

    def consume() -> None:
        with acting_as("ref-worker"):
            while not stop.is_set():
                store.consume("ref", 30, timeout=0.1)
                time.sleep(0.05)

    threads = [threading.Thread(target=write), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    try:
        seen_ref, seen_inserts = [], []
        for _ in range(6):
            page.wait_for_timeout(500)
            seen_ref.append(number(page, "#tasks tr[data-task='ref'] td.delivered"))
            seen_inserts.append(number(page, "#inserts"))
        shot(page, tmp_path, "inspector")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert seen_ref == sorted(seen_ref) and seen_ref[-1] > seen_ref[0], seen_ref
    assert seen_inserts == sorted(seen_inserts) and seen_inserts[-1] > seen_inserts[0], seen_inserts
    page.wait_for_function("Number(document.getElementById('rate-ingest').textContent) >= 0", timeout=5000)

    # when the writer stops, the page settles on exactly what stats() says
    st = store.stats()
    page.wait_for_function(f"document.getElementById('inserts').textContent === '{st['inserts']:,}' && "
                           "document.querySelector(\"#tasks tr[data-task='ref'] td.delivered\").textContent === "
                           f"'{st['consumed']['ref']:,}'", timeout=10_000)
    assert number(page, "#size") == st["size"]
    assert number(page, "#tasks tr[data-task='ref'] td.delivered") == st["consumed"]["ref"]
    chunks = store.chunks()  # the chunk directory, newest first on the page
    page.wait_for_function(f"document.querySelectorAll('#chunk-table tbody tr').length === {min(64, chunks.num_rows)}")
    assert number(page, "#chunk-table tbody tr:first-child td.first-seq") == chunks.column("first_seq")[-1].as_py()
    assert page.inner_text("#chunk-table tbody tr:first-child td.tiers") == f"host: {chunks.num_columns - 4} cols"

    # a SQL query returns rows
    page.fill("#sql-query", "SELECT count(*) AS n FROM experience")
    page.click("#sql-run")
    page.wait_for_selector("#sql-result td")
    assert number(page, "#sql-result td") == st["size"]
    page.fill("#sql-query", "SELECT task, count(consumed_at) AS n FROM lineage GROUP BY 1 ORDER BY 1")
    page.click("#sql-run")
    page.wait_for_function("document.querySelectorAll('#sql-result tr').length === 3")
    assert page.inner_text("#sql-result").split() == ["task", "n", "ref", f"{st['consumed']['ref']:,}", "train",
                                                      "50"]

    # a hostile query is refused with the sandbox's own error
    hostile = "SELECT * FROM read_csv('/etc/passwd')"
    with pytest.raises(ab.InvalidArgument) as sandbox:
        store.sql(hostile)
    page.fill("#sql-query", hostile)
    page.click("#sql-run")
    page.wait_for_function("document.getElementById('sql-error').textContent.length > 0")
    assert page.inner_text("#sql-error") == f"InvalidArgument: {sandbox.value}"
    assert page.locator("#sql-result tr").count() == 0

    # the lineage of a row
    page.fill("#lineage-seq", "7")
    page.click("#lineage-run")
    page.wait_for_selector("#lineage-result td")
    text = page.inner_text("#lineage-result")
    assert "actor-test" in text and "trainer" in text and "ref-worker" in text
    shot(page, tmp_path, "inspector-sql-lineage")
    assert not errors, errors

    # a wrong token is refused: the page asks for the token, the API answers 401
    wrong = browser.new_page(bypass_csp=True)
    wrong.goto(inspector.url + "#token=not-the-token")
    wrong.wait_for_selector("#auth", state="visible", timeout=10_000)
    assert "wrong or missing token" in wrong.inner_text("#auth-error")
    assert wrong.inner_text("#size") == "-"
    shot(wrong, tmp_path, "inspector-wrong-token")
    req = urllib.request.Request(inspector.url + "api/overview", headers={"Authorization": "Bearer nope"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=5)
    assert refused.value.code == 401
    assert (tmp_path / "inspector.png").stat().st_size > 10_000


def test_the_page_labels_both_sizes_lists_ragged_columns_and_says_no_tasks(browser, tmp_path):
    """Issue 44: the page shows the rows' bytes and the reserved bytes of `stats()`, each labelled; its placement
    table lists ragged columns; an empty Tasks table says "no tasks"; the rates box ends under its chart."""
    store = ab.ExperienceStore("grpo", capacity=1000, seed=0)  # ragged fields, no tasks
    n = 40
    store.extend({"prompt_id": np.arange(n) // 4, "prompt_tokens": [[1, 2, 3]] * n, "response_tokens": [[4, 5]] * n,
                  "logprobs": [[-0.1, -0.2]] * n, "policy_version": [0] * n, "done": [True] * n})
    inspector = Inspector(store, "127.0.0.1:0", interval=0.2)
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
        page.goto(inspector.url + "?refresh=250")
        page.wait_for_function("document.getElementById('size').textContent === '40'", timeout=15_000)
        page.wait_for_selector("#columns tbody tr")
        st = store.stats()
        # the same numbers as stats(), in the page's units, under labels that say which size they are
        def kib(b: float) -> str:  # the page's bytes()
            units, i = ["B", "KiB", "MiB", "GiB", "TiB"], 0
            while b >= 1024 and i < 4:
                b, i = b / 1024, i + 1
            return f"{b:.1f} {units[i]}" if i else f"{b:.0f} B"

        assert page.inner_text("#rows-bytes") == kib(st["rows_bytes"])
        assert page.inner_text("#reserved-bytes") == kib(st["reserved_bytes"])
        assert "rows' bytes" in page.inner_text("#overview") and "reserved bytes" in page.inner_text("#overview")
        shown = {r.split("\t")[0]: r.split("\t")[1:] for r in page.inner_text("#columns tbody").splitlines()}
        assert shown["response_tokens"] == [kib(st["columns"]["response_tokens"]["rows_bytes"]),
                                            kib(st["columns"]["response_tokens"]["reserved_bytes"])]
        placed = page.inner_text("#placement tbody")
        for name in ("prompt_tokens", "response_tokens", "logprobs", "ref_logprobs"):  # the ragged columns
            assert name in placed
        assert "no tasks" in page.inner_text("#tasks tbody")
        rates = page.locator("section", has=page.locator("#rates-chart")).bounding_box()
        chart = page.locator("#rates-chart").bounding_box()
        assert rates is not None and chart is not None
        assert rates["y"] + rates["height"] - (chart["y"] + chart["height"]) < 40, (rates, chart)  # no empty area
        shot(page, tmp_path, "inspector-grpo-no-tasks")
    finally:
        inspector.close()
        store.close()


def test_the_inspector_binds_loopback_unless_given_a_token():
    store = ab.ExperienceStore(SCHEMA, capacity=10)
    with pytest.raises(ab.InvalidArgument):
        Inspector(store, "0.0.0.0:0")
    with Inspector(store, "127.0.0.1:0") as ins:
        assert ins.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(ins.url + "api/overview", timeout=5) as r:
            assert r.status == 200
        big = urllib.request.Request(ins.url + "api/sql", data=b"x" * (1 << 20), method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as too_big:
            urllib.request.urlopen(big, timeout=5)
        assert too_big.value.code == 413
    store.close()
