"""The engine with LoRA slots (CPU, the tiny default model, adapters made by peft): requests name an
adapter; a batch mixing adapters and none equals each request alone; slots are granted, reused and
evicted least recently used, never from a running request; adapters are verified when loaded (a
graph that mixes up adapter rows refuses them) and loading captures nothing again; what cannot be
served is refused naming the field while the engine keeps serving."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import workers.serving.engine
from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from tests.lora_adapters import adapter_for
from tests.unit.engine_fixtures import Tiny, load_tiny
from tests.unit.graph_faults import EagerGraphRunner
from workers.modeling.checkpoint import load_model
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import InvalidRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[256, 5, 17, 42], [256, 9], [256, 33, 2, 7, 11, 90], [256, 61, 3]]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    options = {
        "all": dict(r=4, lora_alpha=16, target_modules="all-linear"),
        "attn": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
        "mlp": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    }
    return {
        name: str(adapter_for(tiny.model_dir, root / name, seed=i + 1, **o))
        for i, (name, o) in enumerate(options.items())
    }


def lora_engine(tiny: Tiny, max_loras: int = 3, max_num_seqs: int = 4, **config) -> LLMEngine:
    """An engine over its own copy of the tiny model (LoRA slots change the model)."""
    model = load_model(tiny.model_dir, tiny.max_model_len, dtype=torch.float32)  # exact comparisons hold
    limits = LoraLimits(max_loras=max_loras, max_lora_rank=8, **config.pop("limits", {}))
    cfg = EngineConfig(max_model_len=tiny.max_model_len, device="cpu", max_num_seqs=max_num_seqs, lora=limits, **config)
    return LLMEngine(model, cfg, tiny.eos_token_ids)


def run(engine: LLMEngine, requests: list[tuple[list[int], str | None]], adapters: dict[str, str]) -> list[list[int]]:
    seqs = [engine.add_request(p, GREEDY, adapter=(a, adapters[a]) if a else None) for p, a in requests]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_a_batch_mixing_adapters_and_none_equals_each_request_alone(tiny, adapters):
    requests = list(zip(PROMPTS, ["all", None, "attn", "all"], strict=True))
    together = run(lora_engine(tiny), requests, adapters)
    alone = [run(lora_engine(tiny, max_num_seqs=1), [r], adapters)[0] for r in requests]
    assert together == alone
    base = run(lora_engine(tiny), [(p, None) for p in PROMPTS], adapters)
    assert together[1] == base[1]
    assert together[0] != base[0] and together[2] != base[2]  # the adapters change the tokens


def test_slots_are_reused_and_evicted_least_recently_used_never_while_in_use(tiny, adapters):
    engine = lora_engine(tiny, max_loras=1)
    first = engine.add_request(PROMPTS[0], GREEDY, adapter=("all", adapters["all"]))
    second = engine.add_request(PROMPTS[1], GREEDY, adapter=("attn", adapters["attn"]))
    assert first.adapter_slot == 1 and second.adapter_slot == 0  # one slot, pinned by the first
    engine.step()
    assert list(engine.scheduler.running) == [first.request_id]  # the second waits for the slot
    while engine.has_work():
        engine.step()
    assert second.adapter_slot == 0 and len(second.output_ids) == GREEDY.max_tokens
    assert engine.stats.adapter_loads == {"loaded": 2}
    assert engine.status().lora["adapters"] == {"attn": {"slot": 1, "requests": 0}}
    assert [first.output_ids, second.output_ids] == [
        run(lora_engine(tiny, max_num_seqs=1), [(PROMPTS[i], a)], adapters)[0] for i, a in ((0, "all"), (1, "attn"))
    ]
    again = engine.add_request(PROMPTS[1], GREEDY, adapter=("attn", adapters["attn"]))
    assert again.adapter_slot == 1 and engine.stats.adapter_loads == {"loaded": 2}  # still loaded: no copy


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_slot_pinned_only_by_requests_queued_later_does_not_hold_up_the_queues_head(tiny, adapters, prefix_caching):
    """One slot: the first request (adapter `all`) runs, the second (`attn`) waits at the head of
    the queue, and a third for `all`, queued behind it, pinned the slot on arrival. When the first
    ends, the head gets the slot (the third pins it again after it): all three finish, each with
    the tokens it has alone (it used to wait for ever)."""
    engine = lora_engine(tiny, max_loras=1, max_num_seqs=1, enable_prefix_caching=prefix_caching)
    order = [(PROMPTS[0], "all"), (PROMPTS[1], "attn"), (PROMPTS[0] + [7], "all")]
    seqs = [engine.add_request(p, GREEDY, adapter=(a, adapters[a])) for p, a in order]
    assert [s.adapter_slot for s in seqs] == [1, 0, 1]
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert engine.adapter_slots.pins == {1: 0}
    alone = [run(lora_engine(tiny, max_num_seqs=1), [r], adapters)[0] for r in order]
    assert [s.output_ids for s in seqs] == alone


def test_an_adapter_that_fails_to_load_at_the_queues_head_ends_its_request_counted(tiny, adapters, tmp_path):
    """One slot, pinned by a running request: the next request's adapter loads when it reaches the
    queue's head, and fails there. It ends with an error event and is counted as finished (it was
    not: finished plus aborted fell short of the requests submitted)."""
    engine = lora_engine(tiny, max_loras=1, max_num_seqs=1)
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(open(f"{adapters['mlp']}/adapter_config.json").read())
    data = open(f"{adapters['mlp']}/adapter_model.safetensors", "rb").read()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    good = engine.add_request(PROMPTS[0], GREEDY, adapter=("all", adapters["all"]))
    failing = engine.add_request(PROMPTS[1], GREEDY, adapter=("mlp", str(bad)))
    events = []
    while engine.has_work():
        events += engine.step()
    assert (good.finish_reason, failing.finish_reason) == ("length", "error")
    assert [e.finish_reason for e in events if e.request_id == failing.request_id] == ["error"]
    assert engine.stats.snapshot()["finished_requests"] == {"length": 1, "error": 1}


def adapter_rows_rolled(model):
    """A LoRA graph whose rows read the previous row's adapter slot (plain rows unaffected)."""

    def step(tokens, positions, slots, cache, adapters=None):
        return model.decode(tokens, positions, slots, cache, None if adapters is None else adapters.roll(1))

    return step


def test_lora_graphs_that_mix_up_adapter_rows_fail_startup_verification(tiny, adapters, monkeypatch):
    """Startup verification fills every slot with random adapters: a LoRA bucket whose rows read
    their neighbour's slot is withdrawn, the plain bucket of that size replays on."""

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        return EagerGraphRunner(
            model,
            cache,
            policy,
            {4: adapter_rows_rolled(model)} if lora else {},
            lora=lora,
            prefill_buckets=prefill_buckets,
        )

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    engine = lora_engine(tiny, graph_policy=GraphPolicy(decode_batch_buckets=(1, 2, 4)))
    assert engine.runners.lora.table.ready == {1, 2} and engine.runner.table.ready == {1, 2, 4}
    assert engine.status().buckets["lora_decode_bs_4"]["fallback_reason"] == "verify_mismatch"
    assert not any(lin.a.any() or lin.b.any() for lin in engine.model.lora.linears.values())  # emptied again
    requests = list(zip(PROMPTS, ["all", None, "attn", "mlp"], strict=True))
    assert run(engine, requests, adapters) == run(lora_engine(tiny), requests, adapters)


def test_an_adapter_whose_probe_replay_differs_is_refused_and_loading_captures_nothing(tiny, adapters, monkeypatch):
    captures = []

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        made = EagerGraphRunner(model, cache, policy, lora=lora, prefill_buckets=prefill_buckets)
        original = made._capture_bucket
        made._capture_bucket = lambda bucket: captures.append((lora, bucket)) or original(bucket)
        return made

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    engine = lora_engine(tiny, graph_policy=GraphPolicy(decode_batch_buckets=(1, 2, 4)))
    assert sorted(captures) == [(False, 1), (False, 2), (False, 4), (True, 1), (True, 2), (True, 4)]
    assert run(engine, [(PROMPTS[0], "all")], adapters)  # loads and verifies "all", captures nothing
    lora, rolled = engine.runners.lora, adapter_rows_rolled(engine.model)
    for bucket in (1, 2, 4):  # every LoRA graph breaks after startup
        lora._replays[bucket] = lambda views=lora.model_runner.views(bucket): rolled(*views[:3], lora.cache, views[3])
    with pytest.raises(InvalidRequest, match="adapter 'attn' cannot be served: verification"):
        engine.add_request(PROMPTS[0], GREEDY, adapter=("attn", adapters["attn"]))
    assert engine.stats.adapter_loads == {"loaded": 1, "refused": 1}
    assert set(engine.status().lora["adapters"]) == {"all"} and not engine.has_work()
    assert len(captures) == 6  # no recapture on load
    plain = run(engine, [(p, None) for p in PROMPTS], adapters)  # the engine serves on
    assert plain == run(lora_engine(tiny), [(p, None) for p in PROMPTS], adapters)


def test_graph_replays_with_adapters_equal_eager(tiny, adapters, monkeypatch):
    """With stand-in graphs (the real capture bookkeeping, dispatch and static inputs), rows with
    adapters replay the LoRA runner's buckets and decode what an eager engine decodes; so does a
    lone request's prefill of a few tokens, as rows of the LoRA runner's decode step."""

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        return EagerGraphRunner(model, cache, policy, lora=lora, prefill_buckets=prefill_buckets)

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    requests = list(zip(PROMPTS[:3], ["all", None, "mlp"], strict=True))
    graphs = lora_engine(tiny, graph_policy=GraphPolicy(decode_batch_buckets=(1, 2, 4)))
    got = run(graphs, requests, adapters)
    alone = run(graphs, [(PROMPTS[0], "attn")], adapters)
    monkeypatch.undo()
    assert got == run(lora_engine(tiny), requests, adapters)
    assert alone == run(lora_engine(tiny), [(PROMPTS[0], "attn")], adapters)
    buckets = {p["bucket_id"] for p in graphs.stats.snapshot()["decode_step_parts"] if p["execution_mode"] != "eager"}
    assert "lora_decode_bs_4" in buckets
    prefills = {(p["execution_mode"], p["bucket_id"]) for p in graphs.stats.snapshot()["prefill_step_parts"]}
    assert prefills == {("eager", "none"), ("cuda_graph", "lora_decode_bs_4")}  # 12 tokens together; 4 alone
    assert graphs.runners.lora.replayed[4] > 0 and graphs.stats.adapter_tokens == {"all": 12, "mlp": 12, "attn": 12}


def test_compiled_lora_rows_share_the_layer_graph_and_equal_eager(tiny, adapters, monkeypatch, tmp_path):
    """Compiled by layer (CPU, inductor's C++ backend): the LoRA runner reuses the plain runner's
    compiled start and end and adds at most one layer graph per side of a row-count guard, since its
    layers' MLP outputs (views into a wider GEMM output) are packed so that the first layer's zero
    delta and the others share one; and it decodes what an uncompiled eager engine decodes."""

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        compiled = EagerGraphRunner(model, cache, policy, lora=lora, prefill_buckets=prefill_buckets)
        compiled.use_compiled_step()
        return compiled

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the engine sets them: put back after
        monkeypatch.delenv(variable, raising=False)
    torch._dynamo.reset()  # graphs other tests compiled for these code objects would be reused, not counted
    requests = list(zip(PROMPTS[:3], ["all", None, "mlp"], strict=True))
    policy = GraphPolicy(decode_batch_buckets=(1, 2, 4), compile=True)
    compiled = lora_engine(tiny, graph_policy=policy, compile_cache_dir=str(tmp_path))
    got = run(compiled, requests, adapters)
    monkeypatch.undo()
    assert compiled.runner.graphs == 3 and 1 <= compiled.runners.lora.graphs <= 2
    assert compiled.runners.lora.replayed[4] > 0
    assert got == run(lora_engine(tiny), requests, adapters)


def broken(adapters: dict[str, str], tmp_path, change) -> str:
    path = tmp_path / "broken"
    path.mkdir()
    config = json.loads((open(f"{adapters['all']}/adapter_config.json")).read())
    weights = load_file(f"{adapters['all']}/adapter_model.safetensors")
    config, weights = change(config, weights)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(weights, path / "adapter_model.safetensors")
    return str(path)


def _nan(config, weights):
    key = next(iter(weights))
    weights[key][0, 0] = float("nan")
    return config, weights


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c, w: ({**c, "r": 16}, w), "r: rank 16 is above max_lora_rank 8"),
        (lambda c, w: ({**c, "use_dora": True}, w), "use_dora"),
        (_nan, "NaN or inf"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_why_and_the_engine_serves_on(tiny, adapters, tmp_path, change, field):
    engine = lora_engine(tiny)
    with pytest.raises(InvalidRequest, match=field):
        engine.add_request(PROMPTS[0], GREEDY, adapter=("bad", broken(adapters, tmp_path, change)))
    assert not engine.has_work() and engine.status().lora["adapters"] == {}
    assert run(engine, [(PROMPTS[0], "all")], adapters)[0] == run(lora_engine(tiny), [(PROMPTS[0], "all")], adapters)[0]


def test_a_failed_load_frees_its_slot_and_a_retry_never_runs_on_another_adapters_weights(
    tiny, adapters, tmp_path, monkeypatch
):
    """Two slots hold `all` and `attn`; a request for an adapter whose file is truncated evicts one
    to load into it and fails (a 400 naming the file). The slot is not left pinned or named for
    it: a retry fails the same way (it used to run on the evicted adapter's weights), and the
    adapters still loadable serve their own tokens."""
    engine = lora_engine(tiny, max_loras=2)
    for name in ("all", "attn"):
        run(engine, [(PROMPTS[0], name)], adapters)
    path = tmp_path / "truncated"
    path.mkdir()
    (path / "adapter_config.json").write_text(open(f"{adapters['mlp']}/adapter_config.json").read())
    data = open(f"{adapters['mlp']}/adapter_model.safetensors", "rb").read()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    for _ in range(3):
        with pytest.raises(InvalidRequest, match="adapter_model.safetensors: cannot be read"):
            engine.add_request(PROMPTS[0], GREEDY, adapter=("mlp", str(path)))
    assert not any(engine.adapter_slots.pins.values())
    assert "mlp" not in engine.status().lora["adapters"]
    with monkeypatch.context() as m:  # a failure other than the adapter's own cleans up the same way
        m.setattr(workers.serving.engine, "load_adapter", lambda *a: (_ for _ in ()).throw(RuntimeError("fault")))
        with pytest.raises(RuntimeError, match="fault"):
            engine.add_request(PROMPTS[0], GREEDY, adapter=("mlp", adapters["mlp"]))
    assert not any(engine.adapter_slots.pins.values()) and "mlp" not in engine.status().lora["adapters"]
    for name in ("all", "attn", "mlp"):
        assert run(engine, [(PROMPTS[1], name)], adapters) == run(lora_engine(tiny), [(PROMPTS[1], name)], adapters)


def test_a_target_outside_the_slots_and_lora_off_are_refused(tiny, adapters):
    engine = lora_engine(tiny, limits={"target_modules": ("q_proj", "v_proj")})
    with pytest.raises(InvalidRequest, match=r"target_modules: \['down_proj', 'gate_proj'"):
        engine.add_request(PROMPTS[0], GREEDY, adapter=("all", adapters["all"]))
    assert run(engine, [(PROMPTS[0], "attn")], adapters)  # what fits the slots serves
    off = LLMEngine(
        load_model(tiny.model_dir, tiny.max_model_len),
        EngineConfig(max_model_len=tiny.max_model_len, device="cpu"),
        tiny.eos_token_ids,
    )
    with pytest.raises(InvalidRequest, match="LoRA is not enabled"):
        off.add_request(PROMPTS[0], GREEDY, adapter=("all", adapters["all"]))
    assert off.status().lora is None and off.model.lora is None and off.runners.lora is None


def test_screening_refuses_what_loading_refuses_until_a_load_succeeds(tiny, adapters, tmp_path):
    """A restart that narrowed the slots (here to q_proj and v_proj) or lowered max_lora_rank:
    screening the served adapters reads their configs alone and refuses each with the reason its
    load gives; the status lists them (the ingress keeps them from /v1/models). A request loads
    again: once the files are mended it serves and the refusal is gone; new weights forget all."""
    import shutil

    engine = lora_engine(tiny, limits={"target_modules": ("q_proj", "v_proj")})
    served = {
        "all": adapters["all"],
        "attn": adapters["attn"],
        "wide": broken(adapters, tmp_path, lambda c, w: ({**c, "r": 16}, w)),
        "gone": str(tmp_path / "nonexistent"),
    }
    refused = engine.screen_adapters(served)
    assert set(refused) == {"all", "wide", "gone"}
    assert "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'up_proj'] are outside" in refused["all"]
    assert refused["wide"] == "r: rank 16 is above max_lora_rank 8" and "no adapter_config.json" in refused["gone"]
    assert engine.adapter_slots.holder == {}  # nothing was loaded to find it out
    for name in refused:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request(PROMPTS[0], GREEDY, adapter=(name, served[name]))
        assert str(e.value) == f"adapter {name!r} cannot be served: {refused[name]}"
    status = engine.status().lora["refused"]
    assert status == {name: {"path": served[name], "reason": why} for name, why in refused.items()}
    shutil.copytree(adapters["attn"], served["gone"])  # mended: it fits the slots
    assert run(engine, [(PROMPTS[0], "gone")], served) == run(engine, [(PROMPTS[0], "attn")], served)
    assert set(engine.status().lora["refused"]) == {"all", "wide"}
    engine.forget_adapters()
    assert engine.status().lora["refused"] == {}


def test_check_adapter_loads_and_verifies_without_a_request(tiny, adapters):
    engine = lora_engine(tiny)
    report = engine.check_adapter("mlp", adapters["mlp"])
    assert report["slot"] == 1 and report["seconds"] > 0
    assert engine.status().lora["adapters"] == {"mlp": {"slot": 1, "requests": 0}}
    assert engine.status().memory_mb["lora"] > 0
    with pytest.raises(InvalidRequest, match="no adapter_config.json"):
        engine.check_adapter("missing", "/nonexistent/adapter")


def test_an_adapter_retrained_into_the_same_directory_is_loaded_again(tiny, adapters, tmp_path):
    """The slot holding (name, path) served the weights it loaded first for as long as it held
    them: a user who saved a retrained adapter over the old one, or replaced the directory, got the
    old adapter's tokens (and a damaged replacement passed registration without being read). A
    request running with the old load keeps it to its end."""
    import shutil

    path = tmp_path / "sql"
    shutil.copytree(adapters["attn"], path)
    engine = lora_engine(tiny)
    running = engine.add_request(PROMPTS[2], GREEDY, adapter=("sql", str(path)))
    engine.step()
    shutil.rmtree(path)
    shutil.copytree(adapters["mlp"], path)  # copy2 keeps the files' modification times
    after = run(engine, [(PROMPTS[0], "sql")], {"sql": str(path)})
    assert after == run(lora_engine(tiny), [(PROMPTS[0], "mlp")], adapters)
    assert running.output_ids == run(lora_engine(tiny), [(PROMPTS[2], "attn")], adapters)[0]
    assert engine.adapter_slots.dropped == set() and len(engine.adapter_slots.holder) == 1
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidRequest, match="adapter 'sql' cannot be served"):
        engine.check_adapter("sql", str(path))
    assert run(engine, [(PROMPTS[1], None)], adapters)  # it keeps serving


def test_rows_denied_graphs_decode_eager_with_their_adapter(tiny, adapters, monkeypatch):
    """A tenant's graph denial (or a rollout holdback) sends its rows eager, adapter and all: the
    same tokens as when they replay, next to rows that replay in the same steps."""
    from policies.dispatch import FallbackReason

    def runner(model, cache, policy, lora=False, prefill_buckets=()):
        return EagerGraphRunner(model, cache, policy, lora=lora, prefill_buckets=prefill_buckets)

    monkeypatch.setattr(workers.serving.engine, "GraphRunner", runner)
    engine = lora_engine(tiny, graph_policy=GraphPolicy(decode_batch_buckets=(1, 2, 4)))
    names = ["all", "attn", None, "mlp"]
    seqs = []
    for i, (prompt, name) in enumerate(zip(PROMPTS, names, strict=True)):
        denial = FallbackReason.TENANT_DISABLED if i % 2 else None
        seqs.append(engine.add_request(prompt, GREEDY, graph_denial=denial, adapter=name and (name, adapters[name])))
    while engine.has_work():
        engine.step()
    monkeypatch.undo()
    assert [s.output_ids for s in seqs] == run(lora_engine(tiny), list(zip(PROMPTS, names, strict=True)), adapters)
    parts = {(p["execution_mode"], p["fallback_reason"]) for p in engine.stats.snapshot()["decode_step_parts"]}
    assert ("eager", "tenant_disabled") in parts and ("cuda_graph", "none") in parts
