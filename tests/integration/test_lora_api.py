"""LoRA adapters through a real Ray Serve app (one replica, the tiny shape, adapters made by peft):
the openai client picks an adapter with `model`, /v1/models lists it with its parent, an unknown
name is a 404; operators register, list and remove adapters under load (every request answered),
an adapter that cannot be served is refused with a 400 naming why, and each change is audited; a
restart whose limits refuse a registered adapter lists it as refused and keeps it from /v1/models."""

from __future__ import annotations

import json
import threading
import uuid

import openai
import pytest

from policies.lora_slots import LoraLimits
from tests.integration.helpers import API_KEYS, running_app, wait_for
from tests.lora_adapters import adapter_for
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
MODEL = "lora-base"
MAX_MODEL_LEN = 128
PROMPT = "The capital of"
TOKENS = 8


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    tokenizer = build_byte_tokenizer()
    base = write_checkpoint(tmp / "base", tiny_hf_config(len(tokenizer)), tokenizer, seed=21)
    adapters = {
        "greet": adapter_for(base, tmp / "greet", seed=1, r=4, lora_alpha=32, target_modules="all-linear"),
        "late": adapter_for(base, tmp / "late", seed=2, r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
        "too-big": adapter_for(base, tmp / "too-big", seed=3, r=16, lora_alpha=16, target_modules=["q_proj"]),
    }
    lora = {"lora": {"max_loras": 2, "max_lora_rank": 8}, "lora_modules": {"greet": str(adapters["greet"])}}
    args = {"model": str(base), "served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN, **lora}
    with running_app(tmp, name="lora", args=args, admin_token=ADMIN_TOKEN) as server:
        server.wait_ready()
        yield server, base, {k: str(v) for k, v in adapters.items()}


def alone(base, adapter: tuple[str, str] | None) -> str:
    config = EngineConfig(model=str(base), max_model_len=MAX_MODEL_LEN, device="cpu", lora=LoraLimits(2, 8))
    engine, tokenizer = LLMEngine.from_config(config)
    seq = engine.add_request(
        tokenizer(PROMPT)["input_ids"],
        SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        adapter=adapter,
    )
    while engine.has_work():
        engine.step()
    return tokenizer.decode(seq.output_ids, skip_special_tokens=True)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=API_KEYS["tenant-a"], max_retries=0)


def complete(server, model: str) -> str:
    out = client(server).completions.create(
        model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def admin(server, method: str, path: str, body: dict | None = None):
    return server.http.request(method, path, json=body, headers=server.admin_headers())


def test_the_openai_client_picks_an_adapter_by_model_name(app):
    server, base, adapters = app
    cards = {m.id: m for m in client(server).models.list().data}
    assert set(cards) == {MODEL, "greet"}
    assert cards["greet"].model_extra["parent"] == MODEL and cards["greet"].model_extra["root"] == adapters["greet"]
    assert client(server).models.retrieve("greet").model_extra["parent"] == MODEL
    with_adapter, plain = complete(server, "greet"), complete(server, MODEL)
    assert with_adapter == alone(base, ("greet", adapters["greet"]))
    assert plain == alone(base, None) and plain != with_adapter
    stream = client(server).chat.completions.create(
        model="greet", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert all(chunk.model == "greet" for chunk in stream)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        complete(server, "no-such-adapter")


def test_operators_add_and_remove_adapters_under_load(app):
    server, base, adapters = app
    answers: list[int] = []
    stop = threading.Event()

    def load(model: str) -> None:
        while not stop.is_set():
            r = server.complete(model=model, prompt=PROMPT, max_tokens=4)
            answers.append(r.status_code)

    threads = [threading.Thread(target=load, args=(m,)) for m in (MODEL, "greet", MODEL)]
    for t in threads:
        t.start()
    try:
        refused = admin(server, "POST", "/admin/lora-adapters", {"name": "too-big", "path": adapters["too-big"]})
        assert refused.status_code == 400 and "r: rank 16 is above max_lora_rank 8" in refused.json()["detail"]
        assert admin(server, "POST", "/admin/lora-adapters", {"name": "x y", "path": "/p"}).status_code == 400
        assert admin(server, "POST", "/admin/lora-adapters", {"name": MODEL, "path": "/p"}).status_code == 400
        nul = admin(server, "POST", "/admin/lora-adapters", {"name": "nul", "path": "/x\u0000y"})
        assert nul.status_code == 400, nul.text  # was a 500: "embedded null byte" in the replica
        missing = admin(server, "POST", "/admin/lora-adapters", {"name": "gone", "path": "/nonexistent"})
        assert missing.status_code == 400 and "adapter_config.json" in missing.json()["detail"]
        added = admin(server, "POST", "/admin/lora-adapters", {"name": "late", "path": adapters["late"]})
        assert added.status_code == 201, added.text
        assert added.json()["added_by"] == "admin" and added.json()["checked_by"]["slot"] in (1, 2)
        assert complete(server, "late") == alone(base, ("late", adapters["late"]))
        listed = wait_for(
            lambda: (
                (b := admin(server, "GET", "/admin/lora-adapters").json())
                and all(a["replicas"] for a in b["adapters"])
                and b
            ),
            20,
            what="both adapters held",
        )
        assert {a["name"]: a["source"] for a in listed["adapters"]} == {"greet": "config", "late": "admin"}
        assert listed["lora"]["max_loras"] == 2
        assert admin(server, "DELETE", "/admin/lora-adapters/greet").status_code == 409  # the config's
        assert admin(server, "DELETE", "/admin/lora-adapters/late").status_code == 200
        assert admin(server, "DELETE", "/admin/lora-adapters/late").status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete(server, "late")
        wait_for(lambda: len(answers) > 12, 60, what="requests under load")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert answers and set(answers) == {200}, answers
    audit = admin(server, "GET", "/admin/audit").json()["audit"]
    actions = [(a["action"], a.get("adapter"), a["actor"]) for a in audit if "lora" in a["action"]]
    assert actions == [("add_lora_adapter", "late", "admin"), ("remove_lora_adapter", "late", "admin")]
    assert ADMIN_TOKEN not in json.dumps(audit)
    metrics = server.http.get("/metrics").text
    assert 'graphserve_lora_generated_tokens_total{adapter="greet"' in metrics
    assert "graphserve_lora_adapter_loads_total{replica=" in metrics


def test_a_restart_with_a_lower_max_lora_rank_refuses_a_registered_adapter_saying_why(app):
    """An operator registered `late` (rank 8), then the deployment restarts with max_lora_rank 4.
    The registration stays (raising the rank again serves it), but the replica refuses the adapter
    from the start: /admin/lora-adapters says why, /v1/models leaves it out, a request for it is a
    400 naming the rank (it was listed, and every request for it a 400), and `greet` serves on."""
    from ray import serve

    from app import deployment

    server, _, adapters = app
    added = admin(server, "POST", "/admin/lora-adapters", {"name": "late", "path": adapters["late"]})
    assert added.status_code == 201, added.text
    server.args["lora"] = {"max_loras": 2, "max_lora_rank": 4}
    serve.run(deployment(server.args), blocking=False, name="graphserve-lora")
    listed = wait_for(
        lambda: (
            (b := admin(server, "GET", "/admin/lora-adapters").json())
            and b["lora"]["max_lora_rank"] == 4
            and any("refused" in a for a in b["adapters"])
            and b
        ),
        120,
        what="the restarted replica's refusal of late",
    )
    adapters_listed = {a["name"]: a for a in listed["adapters"]}
    assert adapters_listed["late"]["refused"] == "r: rank 8 is above max_lora_rank 4"
    assert adapters_listed["late"]["source"] == "admin" and "refused" not in adapters_listed["greet"]
    assert {m.id for m in client(server).models.list().data} == {MODEL, "greet"}
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("late")
    with pytest.raises(openai.BadRequestError, match="rank 8 is above max_lora_rank 4"):
        complete(server, "late")
    assert complete(server, "greet")
