"""A rollout of the deployed app (Ray Serve, the controller, a replica with its engine child) on the
GPU, rolled back by online shadow verification of a real captured graph.

At 50% by request, seeded sampled requests get the same tokens in the graph cohort (bucket 1
replayed) as in the holdback (eager). Then the fault file makes bucket 1's replay drift
(`workers/graphs/fault_injection.py`): the engine's next shadow check catches it, the replica's report
brings the mismatch to the controller, and the rollout is rolled back within 1 s of the fault at
this test's sampling rate (one replay in EVERY checked). From then on every request decodes eager
as rollout_holdback, with the tokens it had before the fault, and the audit log names the bucket.
Requests go one at a time, so every decode step has one row: bucket 1, or eager at batch size 1.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import pytest

from tests.integration.helpers import running_app, settled, wait_for
from workers.graphs.fault_injection import VARIABLE

pytestmark = pytest.mark.gpu
ray = pytest.importorskip("ray")

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
EVERY = 8
ARGS = {
    "max_num_seqs": 8,
    "cuda_graph_policy": {"decode_batch_buckets": [1, 2, 4, 8], "compile": False, "shadow_verify_every_n_steps": EVERY},
}
PLAN = {
    "steps": [{"percent": 50, "hold_s": 3600}, {"percent": 100}],
    "unit": "request",
    "guards": {"interval_s": 0.5, "min_samples": 10**9},
}
SEEDED = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.0, "seed": 1234}
ROLLBACK_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-rollout")
    fault = tmp / "fault"
    env = {VARIABLE: str(fault)}
    with running_app(tmp, name="gpu-rollout", args=ARGS, admin_token=ADMIN_TOKEN, extra_env=env) as server:
        server.wait_ready(timeout=600)
        yield server, fault


def rollout(server, method: str = "GET", path: str = "/current", body: dict | None = None) -> dict:
    r = server.http.request(method, f"/admin/rollouts{path}", json=body, headers=server.admin_headers())
    assert r.status_code in (200, 201), r.text
    return r.json()


def seeded(server) -> dict:
    r = server.complete("tenant-a", **SEEDED)
    assert r.status_code == 200, r.text
    return r.json()


def seeded_text(server) -> str:
    return seeded(server)["choices"][0]["text"]


def cohort_requests(server) -> dict[str, int]:
    cohorts = server.replica_status()["requests"]["cohorts"]
    return {c: cohorts.get(c, {}).get("requests", 0) for c in ("graph", "holdback")}


def decode_rows(status: dict) -> dict[tuple[str, str], int]:
    parts = status["stats"]["decode_step_parts"]
    return {(p["execution_mode"], p["fallback_reason"]): p["rows"] for p in parts}


def test_a_faulty_bucket_rolls_the_rollout_back_within_a_second(app):
    server, fault = app
    assert rollout(server, "POST", "", PLAN)["phase"] == "Progressing"

    texts = []

    def both_cohorts_served() -> bool:
        texts.append(seeded_text(server))
        counts = settled(lambda: cohort_requests(server), settle_s=0.5)
        return min(counts.values()) >= 3

    wait_for(both_cohorts_served, 120, interval=0, what="seeded requests in both cohorts")
    assert len(set(texts)) == 1, texts  # graph replay and eager decoding drew the same tokens
    before = decode_rows(settled(server.replica_status, settle_s=0.5))
    assert before[("cuda_graph", "none")] > 0 and before[("eager", "rollout_holdback")] > 0, before

    stop = threading.Event()
    traffic = threading.Thread(target=lambda: [seeded_text(server) for _ in iter(stop.is_set, True)], daemon=True)
    traffic.start()
    try:
        fault.write_text("1")
        injected = time.monotonic()
        current = wait_for(
            lambda: (r := rollout(server))["phase"] == "RolledBack" and r,
            30,
            interval=0.02,
            what="the rollout to roll back",
        )
        latency = time.monotonic() - injected
    finally:
        stop.set()
        traffic.join(60)
    print(f"rolled back {latency:.3f} s after the fault was injected")
    assert latency < ROLLBACK_WITHIN_S, latency
    assert current["percent"] == 0 and "decode_bs_1" in current["reason"] and "mismatch" in current["reason"]
    audit = server.http.get("/admin/audit", headers=server.admin_headers()).json()["audit"]
    last = audit[-1]
    assert (last["actor"], last["phase"]) == ("controller", "RolledBack") and "decode_bs_1" in last["reason"]

    status = server.replica_status()
    assert status["buckets"]["decode_bs_1"]["fallback_reason"] == "verify_mismatch", status["buckets"]
    assert status["buckets"]["decode_bs_2"]["ready"]  # the others still replay (for a cohort, once there is one)
    assert status["stats"]["shadow"]["mismatches"] == 1
    metrics = server.http.get("/metrics").text
    mismatches = r'shadow_verifications_total\{bucket_id="decode_bs_1",replica="[^"]+",result="mismatch"\} 1\.0'
    assert re.search(mismatches, metrics), metrics

    after = decode_rows(settled(server.replica_status))  # no rollout splits traffic now: reports come 1 s apart
    answer = seeded(server)
    assert answer["choices"][0]["text"] == texts[0]  # eager, with the tokens it had before the fault
    final = decode_rows(settled(server.replica_status))
    grown = {key: final[key] - after.get(key, 0) for key in final if final[key] != after.get(key, 0)}
    stopped = answer["choices"][0]["finish_reason"] == "stop"  # its EOS came from one more decode step
    assert grown == {("eager", "rollout_holdback"): answer["usage"]["completion_tokens"] - 1 + stopped}, grown
