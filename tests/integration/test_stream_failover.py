"""Streams survive the loss of a replica's engine: with two replicas, the engine child of one is
killed (SIGKILL) while streams run on it, and every request completes as one uninterrupted stream
whose text, finish reason and usage equal a reference run of the same requests on the same app
without the kill: greedy and seeded streams, a stream with a stop string, non-streamed requests,
requests for several choices (streamed and not; each unfinished choice goes on by itself), and an
unseeded sampled stream through a LoRA adapter (its drawn seed and its adapter carry over to the
other replica; sent back as `seed`, the seed it reports samples the same completion again), and
streams under a JSON schema (their continuations replay the tokens sent into their grammar).

The OpenAI API returns text, not token ids: with the tiny model's byte-level tokenizer every token is
one byte of the text, so a continuation that drew one token differently would show in the text (and
token-for-token equality of continuations is tested in tests/unit/test_failover.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.integration.helpers import API_KEYS, httpx, running_app, wait_for
from tests.lora_adapters import adapter_for
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint

pytestmark = pytest.mark.timeout(300)
APP = "failover"
MODEL = "failover-base"
ADAPTER = "greet"
MAX_TOKENS = 256  # long enough that the kill, sent once every stream has text, lands mid-stream
STREAMS = 16  # greedy and seeded streams, besides the requests below
CHOICE_REQUESTS = 4  # seeded, n = 3, streamed and not
UNSEEDED = "unseeded-adapter"  # the one request of tenant-b: the victim's counts show it was hit
WORDS = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 60}  # longer than MAX_TOKENS


def requests(stop: str | None = None) -> dict[str, dict]:
    """name -> (completions) body: the streams, two non-streamed requests, the unseeded adapter
    stream and, once its stop string is known, the stop-string stream (greedy-0 cut at it)."""
    bodies = {}
    for i in range(STREAMS):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        bodies[f"{'greedy' if i % 2 == 0 else 'seeded'}-{i}"] = {"prompt": f"Stream {i}:", "stream": True, **sampling}
    bodies["plain-greedy"] = {"prompt": "Plain", "stream": False, "temperature": 0}
    bodies["plain-seeded"] = {"prompt": "Plain seeded", "stream": False, "temperature": 1.0, "seed": 5}
    for i in range(CHOICE_REQUESTS):
        bodies[f"choices-{i}"] = {
            "prompt": f"Choices {i}:",
            "stream": i % 2 == 0,
            "n": 3,
            "temperature": 0.9,
            "seed": 300 + i,
        }
    schema = {"type": "json_schema", "json_schema": {"name": "words", "schema": WORDS}}
    for i, n in enumerate((1, 2)):
        sampling = {"temperature": 0.9, "seed": 400 + i, "n": n}
        bodies[f"schema-{n}"] = {"prompt": f"Words {i}:", "stream": True, "response_format": schema, **sampling}
    bodies[UNSEEDED] = {
        "model": ADAPTER,
        "prompt": "Unseeded",
        "stream": True,
        "temperature": 1.0,
        "max_tokens": 4 * MAX_TOKENS,
    }
    if stop is not None:
        bodies["stop"] = {**bodies["greedy-0"], "stop": [stop]}
    return {name: {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, **b} for name, b in bodies.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp(APP)
    tokenizer = build_byte_tokenizer()
    base = write_checkpoint(tmp / "base", tiny_hf_config(len(tokenizer)), tokenizer, seed=3)
    adapter = adapter_for(base, tmp / ADAPTER, seed=1, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    args = {
        "model": str(base),
        "served_model_name": MODEL,
        "max_model_len": 5 * MAX_TOKENS,
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
        "lora": {"max_loras": 2, "max_lora_rank": 8},
        "lora_modules": {ADAPTER: str(adapter)},
    }
    with running_app(tmp, name=APP, admin_token="admin-failover", args=args) as s:
        wait_for(lambda: len(ready_replicas(s)) == 2, 120, interval=0.5, what="both replicas READY")
        yield s


def ready_replicas(server) -> dict[str, dict]:
    return {rid: st for rid, st in server.admin_status()["replicas"].items() if st.get("state") == "READY"}


class Client(threading.Thread):
    """One request in a thread: its text and finish reason per choice, usage, seed header, and
    whether text had arrived and whether it had ended (events, for the moment of the kill)."""

    def __init__(self, server, name: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.name, self.body = server, name, body
        self.had_text, self.done = threading.Event(), threading.Event()
        n = body.get("n", 1)
        self.texts, self.finish_reasons = [""] * n, [None] * n
        self.usage, self.seed = None, None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {**self.body, **({"stream_options": {"include_usage": True}} if self.body["stream"] else {})}
        headers = {"Authorization": f"Bearer {API_KEYS['tenant-b' if self.name == UNSEEDED else 'tenant-a']}"}
        try:
            with httpx.Client(base_url=self.server.base_url, timeout=120) as http:
                if self.body["stream"]:
                    with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                        assert r.status_code == 200, r.read()
                        self.seed = r.headers["x-graphserve-seed"]
                        for line in r.iter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                self._event(json.loads(line[len("data: ") :]))
                else:
                    r = http.post("/v1/completions", json=body, headers=headers)
                    assert r.status_code == 200, r.text
                    self.seed = r.headers["x-graphserve-seed"]
                    self._event(r.json())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.done.set()

    def _event(self, event: dict) -> None:
        assert "error" not in event, event
        for choice in event["choices"]:
            i = choice["index"]
            self.texts[i] += choice["text"]
            self.finish_reasons[i] = choice["finish_reason"] or self.finish_reasons[i]
            self.had_text.set()
        self.usage = event.get("usage") or self.usage

    def result(self) -> tuple:
        """(text, finish reason, usage), text and finish reason per choice when there are several."""
        if len(self.texts) == 1:
            return self.texts[0], self.finish_reasons[0], self.usage
        return tuple(self.texts), tuple(self.finish_reasons), self.usage


def run_all(server, bodies: dict[str, dict]) -> dict[str, Client]:
    clients = {name: Client(server, name, body) for name, body in bodies.items()}
    for client in clients.values():
        client.start()
    return clients


def finish(clients: dict[str, Client]) -> dict[str, Client]:
    for name, client in clients.items():
        client.join(180)
        assert not client.is_alive() and client.error is None, (name, client.error)
    return clients


def adapter_replica(server) -> str | None:
    """The replica running a request for the adapter, once its status says so."""
    for rid, status in ready_replicas(server).items():
        if ((status.get("lora") or {}).get("adapters") or {}).get(ADAPTER, {}).get("requests"):
            return rid
    return None


def engine_pid(replica_id: str) -> int:
    """The engine child of a replica: the process running workers.front.engine_main whose
    parent is the replica's actor process."""
    from ray._private import state

    (actor,) = [a for a in state.actors().values() if a["State"] == "ALIVE" and a["Name"].endswith(f"#{replica_id}")]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and b"workers.front.engine_main" in _read(proc / "cmdline"):
            if int(_read(proc / "stat").rsplit(b")", 1)[1].split()[1]) == actor["Pid"]:
                return int(proc.name)
    raise AssertionError(f"no engine process under replica {replica_id} (pid {actor['Pid']})")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def outcomes(status: dict) -> dict[tuple[str, str], int]:
    """(tenant, outcome) -> requests, of one replica."""
    return {(c["tenant"], c["outcome"]): c["count"] for c in status["requests"]["requests"]}


def failed(after: dict, before: dict, tenant: str) -> int:
    """The requests of a tenant a replica's engine failed between two reads."""
    key = (tenant, "engine_failed")
    return outcomes(after).get(key, 0) - outcomes(before).get(key, 0)


def test_streams_continue_on_the_other_replica_when_an_engine_dies(server):
    started = time.monotonic()
    bodies = requests()
    del bodies[UNSEEDED]  # its seed is drawn anew each time: checked against itself below
    reference = {name: c.result() for name, c in finish(run_all(server, bodies)).items()}
    assert all(text.startswith('["') for text in (reference["schema-1"][0], *reference["schema-2"][0]))
    text0 = reference["greedy-0"][0]
    stop = next(
        text0[i : i + 4]
        for i in range(len(text0) * 2 // 3, len(text0) - 4)
        if "\ufffd" not in text0[i : i + 4] and text0.find(text0[i : i + 4]) > len(text0) // 2
    )
    reference["stop"] = finish(run_all(server, {"stop": requests(stop)["stop"]}))["stop"].result()
    assert reference["stop"][1] == "stop" and text0.startswith(reference["stop"][0])
    reference_s = time.monotonic() - started

    # The victim is the replica running the unseeded stream (its status says where), which starts first.
    before = ready_replicas(server)
    bodies = requests(stop)
    clients = run_all(server, {UNSEEDED: bodies.pop(UNSEEDED)})
    victim = wait_for(lambda: adapter_replica(server), 20, interval=0.1, what="the unseeded stream's replica")
    pid = engine_pid(victim)
    clients |= run_all(server, bodies)
    wait_for(
        lambda: all(c.had_text.is_set() for c in clients.values() if c.body["stream"]),
        60,
        interval=0.01,
        what="every stream under way",
    )
    os.kill(pid, signal.SIGKILL)
    in_flight = [name for name, c in clients.items() if c.had_text.is_set() and not c.done.is_set()]
    killed_at = time.monotonic()
    assert UNSEEDED in in_flight and len(in_flight) >= 6, in_flight
    finish(clients)
    failover_s = time.monotonic() - killed_at

    for name, client in clients.items():
        if name != UNSEEDED:
            assert client.result() == reference[name], name
    text, reason, usage = clients[UNSEEDED].result()
    assert reason == "length" and usage["completion_tokens"] == 4 * MAX_TOKENS
    again = finish(run_all(server, {UNSEEDED: requests()[UNSEEDED] | {"seed": int(clients[UNSEEDED].seed)}}))
    assert again[UNSEEDED].result() == (text, reason, usage)

    # The kill hit the victim's streams, the unseeded one (tenant-b's) among them: their engine
    # failed them there, and they went on on the other replica, whose engine never failed.
    statuses = server.admin_status()["replicas"]
    (other,) = set(before) - {victim}
    assert statuses[victim]["engine_restarts"] == 1 and statuses[other]["engine_restarts"] == 0
    hit = failed(statuses[victim], before[victim], "tenant-a")
    assert failed(statuses[victim], before[victim], "tenant-b") == 1 and hit >= 1, outcomes(statuses[victim])
    assert not any(outcome == "engine_failed" for _, outcome in outcomes(statuses[other]))
    print(
        f"reference runs {reference_s:.1f} s, failover run {failover_s:.1f} s after the kill, "
        f"{len(in_flight)} requests in flight, {hit + 1} failed over"
    )
