"""Model swaps on a real Ray Serve app with two replicas of the tiny shape, under a steady load of
concurrent requests (streamed and not): a swap to other weights of the same shapes (in place), a
swap to a checkpoint of other shapes with its own tokenizer (rebuilt), and a swap to NaN weights
(the gate fails it; both replicas keep serving the model they had). No request fails during a swap,
and afterwards every request gets the tokens the engine alone gives on the checkpoint served."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.integration.helpers import json_events, running_app, wait_for
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
MODEL = "swap-llama"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello", "The capital of", "1 2 3"]
TOKENS = 8


def write_checkpoints(tmp) -> dict:
    tokenizer = build_byte_tokenizer()
    shape = tiny_hf_config(len(tokenizer))
    paths = {
        "v1": write_checkpoint(tmp / "v1", shape, tokenizer, seed=11),
        "v2": write_checkpoint(tmp / "v2", shape, tokenizer, seed=12),
        "nan": write_checkpoint(tmp / "nan", shape, tokenizer, seed=13),
    }
    state = load_file(paths["nan"] / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight"][:, 0] = float("nan")
    save_file(state, paths["nan"] / "model.safetensors", metadata={"format": "pt"})
    wide_tokenizer = build_byte_tokenizer()
    wide_tokenizer.add_tokens([f"<extra_{i}>" for i in range(7)])
    wide = {**tiny_hf_config(len(wide_tokenizer)), "hidden_size": 96, "intermediate_size": 160, "head_dim": 24}
    paths["wide"] = write_checkpoint(tmp / "wide", wide, wide_tokenizer, seed=14)
    return paths


def engine_alone(path) -> list[str]:
    engine, tokenizer = LLMEngine.from_config(EngineConfig(model=str(path), max_model_len=MAX_MODEL_LEN, device="cpu"))
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(tokenizer(p)["input_ids"], params) for p in PROMPTS]
    while engine.has_work():
        engine.step()
    return [tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("swap")
    paths = write_checkpoints(tmp)
    args = {
        "model": str(paths["v1"]),
        "served_model_name": MODEL,
        "model_revision": "v1",
        "autoscaling": {"min_replicas": 2, "max_replicas": 2},
    }
    with running_app(tmp, name="swap", args=args, admin_token=ADMIN_TOKEN) as server:
        wait_for(lambda: len(ready_replicas(server)) == 2, 120, what="two READY replicas")
        yield server, paths


def ready_replicas(server) -> list[str]:
    return [r for r, s in server.admin_status()["replicas"].items() if s["state"] == "READY"]


def served(server) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        r = server.complete(prompt=prompt, max_tokens=TOKENS, temperature=0, ignore_eos=True)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


class Load:
    """Requests in a loop from a few threads while a swap runs; every answer that is not a whole
    completion is kept."""

    def __init__(self, server, threads: int = 4) -> None:
        self.server, self.failures, self.done = server, [], 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0,), daemon=True) for i in range(threads)]

    def _run(self, stream: bool) -> None:
        while not self.stop.is_set():
            body = {
                "model": MODEL,
                "prompt": "Load",
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": stream,
            }
            r = self.server.http.post("/v1/completions", json=body, headers=self.server.key_headers())
            events = json_events(r.text.splitlines()) if stream and r.status_code == 200 else []
            if r.status_code != 200 or any("error" in e for e in events):
                self.failures.append((r.status_code, r.text[:300]))
            self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def swap_to(server, path, revision: str | None) -> dict:
    body = {"model": str(path), **({"revision": revision} if revision else {})}
    r = server.http.post("/admin/model", json=body, headers=server.admin_headers())
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["phase"] == "Progressing" and len(started["order"]) == 2
    return wait_for(
        lambda: (m := model_view(server))["swap"]["phase"] != "Progressing" and m,
        300,
        interval=0.2,
        what="the swap to finish",
    )


def model_view(server) -> dict:
    r = server.http.get("/admin/model", headers=server.admin_headers())
    assert r.status_code == 200, r.text
    return r.json()


def revisions(server) -> list[str]:
    return sorted(s["model_revision"] for s in server.admin_status()["replicas"].values())


def test_swaps_under_load(app):
    server, paths = app
    assert served(server) == engine_alone(paths["v1"])
    assert server.http.post("/admin/model", json={"model": ""}, headers=server.admin_headers()).status_code == 400

    with Load(server) as load:
        view = swap_to(server, paths["v2"], "v2")
    assert view["swap"]["phase"] == "Succeeded", view
    assert load.failures == [] and load.done > 0, load.failures[:3]
    assert {p["path"] for p in view["swap"]["replicas"].values()} == {"in_place"}
    assert [s["step"] for p in view["swap"]["replicas"].values() for s in p["steps"]] == [
        "draining",
        "loading",
        "serving",
    ] * 2
    assert revisions(server) == ["v2", "v2"]
    assert served(server) == engine_alone(paths["v2"])
    (card,) = server.http.get("/v1/models", headers=server.key_headers()).json()["data"]
    assert (card["id"], card["root"], card["revision"]) == (MODEL, str(paths["v2"]), "v2")

    with Load(server) as load:
        view = swap_to(server, paths["nan"], "nan")
    assert view["swap"]["phase"] == "Failed" and "not finite" in view["swap"]["reason"], view["swap"]
    assert sorted(p["step"] for p in view["swap"]["replicas"].values()) == ["reverted", "waiting"]
    assert load.failures == [], load.failures[:3]
    assert revisions(server) == ["v2", "v2"]
    assert served(server) == engine_alone(paths["v2"])

    with Load(server) as load:  # a typo in the path: refused before any replica drains a stream
        view = swap_to(server, Path(paths["v2"]).parent / "no-such-checkpoint", None)
    assert view["swap"]["phase"] == "Failed" and "not a directory" in view["swap"]["reason"], view["swap"]
    assert [s["step"] for p in view["swap"]["replicas"].values() for s in p["steps"]] == ["reverted"]
    assert load.failures == [], load.failures[:3]

    with Load(server) as load:
        view = swap_to(server, paths["wide"], None)
    assert view["swap"]["phase"] == "Succeeded", view
    assert load.failures == [], load.failures[:3]
    assert {p["path"] for p in view["swap"]["replicas"].values()} == {"rebuild"}
    assert served(server) == engine_alone(paths["wide"])
    assert len(set(revisions(server))) == 1 and revisions(server)[0] not in ("v1", "v2")
    audit = server.http.get("/admin/audit", headers=server.admin_headers()).json()["audit"]
    phases = [a["phase"] for a in audit if a["action"] == "swap" and "reason" in a]
    assert phases == ["Succeeded", "Failed", "Failed", "Succeeded"]
