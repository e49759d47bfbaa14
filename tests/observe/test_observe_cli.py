"""`arrowbuf serve --metrics --ui` and `arrowbuf ui` as real processes, and the inspector's HTTP API under hostile
input (Hypothesis): every answer is JSON with a 2xx/4xx status, the server stays up."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.observe.ui import Inspector

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
SCHEMA = {"name": "cli", "fields": {"x": {"dtype": "int64"}, "done": {"dtype": "bool"}}}


def get(url: str, token: str | None = None, data: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def lines_until(proc: subprocess.Popen, n: int) -> list[str]:
    out = []
    while len(out) < n:
        line = proc.stdout.readline().decode()
        assert line, proc.stderr.read().decode()
        out.append(line.strip())
    return out


@pytest.mark.slow
def test_arrowbuf_serve_with_metrics_and_the_inspector(tmp_path):
    (tmp_path / "token").write_text("tok-123\n")
    args = [sys.executable, "-m", "arrowbuf.cli", "serve", "--schema", "cartpole", "--capacity", "100", "--port", "0",
            "--token-file", str(tmp_path / "token"), "--metrics", "127.0.0.1:0", "--ui", "127.0.0.1:0"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        serving, metrics, ui = lines_until(proc, 3)
        location = serving.split(" at ")[1]
        metrics_url = metrics.split(" at ")[1]
        ui_url = ui.split(" at ")[1]
        with ab.connect(location, token="tok-123") as client:
            client.extend({"obs": np.zeros((5, 4), np.float32), "action": np.zeros(5, np.int64),
                           "reward": np.ones(5, np.float32), "terminated": np.zeros(5, bool),
                           "truncated": np.zeros(5, bool), "policy_version": np.zeros(5, np.int64)})
        with urllib.request.urlopen(metrics_url, timeout=20) as r:
            text = r.read().decode()
        assert 'arrowbuf_rows_inserted_total{store="cartpole"} 5.0' in text
        assert get(ui_url + "api/overview")[0] == 401
        status, body = get(ui_url + "api/overview", "tok-123")
        assert status == 200 and body["stats"]["size"] == 5 and body["stats"]["capacity"] == 100
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_arrowbuf_ui_over_a_served_store_with_a_token(tmp_path):
    store = ab.ExperienceStore(SCHEMA, capacity=50, tasks=["t"])
    store.extend({"x": np.arange(7), "done": np.ones(7, bool)})
    with ab.serve(store, "grpc://127.0.0.1:0", token="s3") as server:
        (tmp_path / "token").write_text("s3\n")
        proc = subprocess.Popen([sys.executable, "-m", "arrowbuf.cli", "ui", server.location, "--token-file",
                                 str(tmp_path / "token"), "--interval", "0.2"], cwd=tmp_path, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            url = lines_until(proc, 1)[0].split(" at ")[-1]
            assert get(url + "api/overview", "wrong")[0] == 401
            status, body = get(url + "api/overview", "s3")
            assert status == 200 and body["stats"]["size"] == 7
            status, body = get(url + "api/sql", "s3", json.dumps({"query": "SELECT sum(x) AS s FROM experience"}
                                                                  ).encode())
            assert status == 200 and body["rows"] == [[21]]
            status, body = get(url + "api/lineage?seq=3", "s3")
            assert status == 200 and body["rows"][0][0] == 3 and body["rows"][0][1].startswith("flight:") is False
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    store.close()


@pytest.fixture(scope="module")
def inspector():
    store = ab.ExperienceStore(SCHEMA, capacity=50, tasks=["t"])
    store.extend({"x": np.arange(7), "done": np.ones(7, bool)})
    ins = Inspector(store, "127.0.0.1:0", token="tok")
    yield ins
    ins.close()
    store.close()


def raw(url: str, token: str | None, data: bytes | None, method: str, ctype: str | None = None
        ) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if ctype is not None:
        headers["Content-Type"] = ctype
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.text(max_size=60), body=st.one_of(st.binary(min_size=1, max_size=300),
                                                 st.builds(lambda q: json.dumps({"query": q}).encode(),
                                                           st.text(max_size=200))),
       token=st.sampled_from(["tok", "", "nope"]), ctype=st.sampled_from([None, "application/json", "text/plain"]))
def test_the_inspector_answers_hostile_requests_with_json_and_stays_up(inspector, path, body, token, ctype):
    quoted = urllib.request.quote(path, safe="")
    base = inspector.url
    calls = [(base + quoted, None, "GET"), (base + quoted, body, "POST"), (base + "api/sql", body, "POST"),
             (base + "api/lineage?seq=" + quoted, None, "GET"), (base + "api/" + quoted, None, "GET")]
    for url, data, method in calls:
        status, got, payload = raw(url, token or None, data, method, ctype if data is not None else None)
        assert status in (200, 400, 401, 404, 413, 415), (url, status, payload[:300])
        if got.startswith("text/html"):
            assert status == 200 and url == base  # the page itself, nothing else
            continue
        answer = json.loads(payload)
        assert isinstance(answer, dict)
        if status != 200:
            assert set(answer) == {"error", "code", "message"}, answer
        if token != "tok" and "/api/" in url and status != 404:
            assert status == 401, (url, status)  # the token is checked before anything else of the request
    assert get(base + "api/overview", "tok")[0] == 200
