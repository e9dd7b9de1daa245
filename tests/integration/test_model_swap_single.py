"""A single replica (real Ray Serve, tiny checkpoints): requests sent while it swaps its model wait
and are served afterwards, none lost; a graph-policy rebuild puts the new bucket ladder in force;
the bucket recommendation is fitted to the batch sizes the replica ran."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from policies.bucket_choice import best_buckets, ladder_cost
from tests.integration.helpers import running_app, wait_for
from tests.integration.test_model_swap import MAX_MODEL_LEN, MODEL, engine_alone, write_checkpoints

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swap-single")
    paths = write_checkpoints(tmp)
    # the replica reads a swap's order at its next poll: at the default 0.5 s a stream of the tiny
    # model (8 x 240 tokens in well under a second) could end before it, three times in a row
    args = {
        "model": str(paths["v1"]),
        "served_model_name": MODEL,
        "max_model_len": MAX_MODEL_LEN,
        "toggle_poll_s": 0.05,
    }
    with running_app(tmp, name="swap1", args=args, admin_token=ADMIN_TOKEN) as server:
        server.wait_ready()
        yield server, paths


def admin(server, method: str, path: str, body: dict | None = None):
    return server.http.request(method, path, json=body, headers=server.admin_headers())


def finished_swap(server) -> dict:
    return wait_for(
        lambda: (s := admin(server, "GET", "/admin/model").json()["swap"])["phase"] != "Progressing" and s,
        120,
        interval=0.1,
        what="the swap to finish",
    )


def test_requests_during_a_swap_wait_and_are_served(app):
    server, paths = app
    answers: list[tuple[float, str, int, str]] = []

    def one(prompt: str) -> None:
        sent = time.time()
        r = server.complete(prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        answers.append((sent, prompt, r.status_code, text))

    started = admin(server, "POST", "/admin/model", {"model": str(paths["wide"]), "revision": "wide-1"})
    assert started.status_code == 202, started.text
    threads = [threading.Thread(target=one, args=(p,)) for p in ("Hello", "The capital of", "1 2 3") * 3]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(120)
    swap = finished_swap(server)
    assert swap["phase"] == "Succeeded", swap
    (progress,) = swap["replicas"].values()
    at = {s["step"]: s["at"] for s in progress["steps"]}
    assert any(at["draining"] <= sent <= at["serving"] for sent, *_ in answers), (at, answers)  # some waited
    assert [code for _, _, code, _ in answers] == [200] * len(threads), answers
    prompts = ("Hello", "The capital of", "1 2 3")
    old = dict(zip(prompts, engine_alone(paths["v1"]), strict=True))
    new = dict(zip(prompts, engine_alone(paths["wide"]), strict=True))
    for sent, prompt, _, text in answers:  # sent once the replica drained: the new model's tokens
        assert text == new[prompt] if sent >= at["draining"] else text in (old[prompt], new[prompt]), (prompt, text)
    status = next(iter(server.admin_status()["replicas"].values()))
    assert status["model_revision"] == "wide-1" and status["state"] == "READY"
    assert admin(server, "POST", "/admin/model", {"model": str(paths["v1"]), "colour": 1}).status_code == 400


def test_a_graph_policy_rebuild_and_the_bucket_recommendation(app):
    server, _ = app
    bad = admin(server, "PUT", "/admin/graph-policy", {"decode_batch_buckets": [4, 2]})
    assert bad.status_code == 400 and "decode_batch_buckets" in bad.text
    for query in ("0", "abc", "65", "²", "9" * 5000):
        assert admin(server, "GET", f"/admin/buckets/recommendation?max_buckets={query}").status_code == 400

    threads = [
        threading.Thread(target=server.complete, kwargs={"prompt": "x" * (i + 1), "max_tokens": 24}) for i in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    def recommendation(query: str = "") -> dict:
        return wait_for(
            lambda: (
                (r := admin(server, "GET", f"/admin/buckets/recommendation{query}")).status_code == 200 and r.json()
            ),
            30,
            what="a recommendation",
        )

    rec = recommendation("?max_buckets=3")
    histogram = {int(s): steps for s, steps in rec["batch_sizes"].items()}
    seen = sorted(histogram)
    assert set(rec["recommended"]["buckets"]) <= set(seen) and max(rec["recommended"]["buckets"]) == seen[-1]
    assert len(rec["recommended"]["buckets"]) <= 3 and rec["recommended"]["graph_hit_rate"] == 1.0
    # the optimiser's ladder on the sizes the replica ran (optimal: tests/unit/test_bucket_choice.py),
    # which may pad more than the current ladder: that one may have more buckets
    best = ladder_cost(histogram, best_buckets(histogram, 3))
    assert rec["recommended"]["buckets"] == list(best.buckets)
    assert rec["recommended"]["padding_waste"] == pytest.approx(best.padding_waste)
    as_many = recommendation()  # as many buckets as the current ladder has: never more padding than it
    assert as_many["max_buckets"] == len(as_many["current"]["buckets"])
    assert as_many["recommended"]["padding_waste"] <= as_many["current"]["padding_waste"] + 1e-9

    applied = admin(server, "PUT", "/admin/graph-policy", {"decode_batch_buckets": rec["recommended"]["buckets"]})
    assert applied.status_code == 202, applied.text
    assert finished_swap(server)["phase"] == "Succeeded"
    status = next(iter(server.admin_status()["replicas"].values()))
    assert sorted(status["buckets"]) == sorted(f"decode_bs_{b}" for b in rec["recommended"]["buckets"])
    assert server.complete(prompt="Hello", max_tokens=4).status_code == 200


def drained_stream(server, target) -> tuple[list[dict], bool]:
    """A long stream of 8 choices, then a swap to `target` with a drain timeout far shorter than
    the stream: its events, and whether the swap reached the replica before the stream ended."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 240, "n": 8, "ignore_eos": True, "stream": True}
    events, started = [], None
    with server.http.stream("POST", "/v1/completions", json=body, headers=server.key_headers()) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[len("data: ") :]))
            if started is None:
                started = admin(server, "POST", "/admin/model", {"model": str(target), "drain_timeout_s": 0.01})
                assert started.status_code == 202, started.text
    assert finished_swap(server)["phase"] == "Succeeded"
    return events, "error" in events[-1]


def test_a_stream_past_a_swaps_drain_timeout_ends_with_an_error_event(app):
    """What it generated, then OpenAI's error event (a 503 to retry) and [DONE]: no choice ends
    with a finish reason (it used to end with 'abort', none of OpenAI's, and no error)."""
    server, paths = app
    for target in (paths["v1"], paths["wide"], paths["v1"]):  # the stream may outrun the swap's order
        events, drained = drained_stream(server, target)
        if drained:
            break
    assert drained, "no stream was still running when the swap drained the replica"
    assert events[-1]["error"]["type"] == "service_unavailable" and "drain timeout" in events[-1]["error"]["message"]
    assert all(c["finish_reason"] is None for e in events[:-1] for c in e["choices"])
    assert any(c["text"] for e in events[:-1] for c in e["choices"])
    assert server.complete().status_code == 200  # and the replica serves the new model
