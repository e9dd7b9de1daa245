"""LoRA adapters with real CUDA graphs (tiny shape, adapters made by peft): rows mixing adapters
and none replay token for token what eager decodes, at odd batch sizes and with sampling; loading
an adapter into a slot while other requests decode changes nothing for them and captures nothing;
startup verification leaves the slots empty."""

from __future__ import annotations

import pytest

from policies.graph_policy import GraphPolicy
from policies.lora_slots import LoraLimits
from tests.gpu.test_graph_runner import requests
from tests.lora_adapters import adapter_for
from workers.graphs.graph_runner import GraphRunner
from workers.modeling.synthetic import build_byte_tokenizer, tiny_hf_config, write_checkpoint
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig

pytestmark = pytest.mark.gpu
BUCKETS = (1, 2, 4, 8, 40)  # 40: at or above SLOT_GROUP_ROWS, the kernels' programs take a slot each
OPTIONS = {
    "a": dict(r=4, lora_alpha=32, target_modules="all-linear"),
    "b": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "c": dict(r=2, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-lora")
    tokenizer = build_byte_tokenizer()
    base = write_checkpoint(tmp / "base", tiny_hf_config(len(tokenizer)), tokenizer, seed=31)
    adapters = {n: (n, str(adapter_for(base, tmp / n, seed=i + 1, **o))) for i, (n, o) in enumerate(OPTIONS.items())}
    return base, adapters


def engine_on(base, mode: str = "full") -> LLMEngine:
    policy = GraphPolicy(mode=mode, decode_batch_buckets=BUCKETS, compile=False)
    config = EngineConfig(
        model=str(base),
        max_num_seqs=max(BUCKETS),
        max_model_len=256,
        device="cuda",
        attention_backend="triton",
        graph_policy=policy,
        lora=LoraLimits(max_loras=3, max_lora_rank=8),
    )
    return LLMEngine.from_config(config)[0]


def outputs(engine: LLMEngine, reqs, adapters) -> list[list[int]]:
    seqs = [engine.add_request(p, params, adapter=a) for (p, params), a in zip(reqs, adapters, strict=True)]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def test_mixed_adapter_batches_replay_what_eager_decodes_at_odd_batch_sizes(setup):
    base, adapters = setup
    graph, eager = engine_on(base), engine_on(base, mode="eager")
    assert graph.runners.lora.table.ready == set(BUCKETS) == graph.runner.table.ready
    assert not any(lin.a.any() or lin.b.any() for lin in graph.model.lora.linears.values())  # emptied after verify
    mix = [adapters["a"], None, adapters["b"], adapters["c"]]
    for n in (3, 5, 7, 35):
        reqs = requests(n, seed=50 + n, max_tokens=24)  # every other request sampled, with its own seed
        rows = [mix[i % len(mix)] for i in range(n)]
        got = outputs(graph, reqs, rows)
        assert got == outputs(eager, reqs, rows), n
        assert got != outputs(graph, reqs, [None] * n)  # the adapters matter
    parts = {(p["execution_mode"], p["bucket_id"]) for p in graph.stats.snapshot()["decode_step_parts"]}
    assert {("cuda_graph", f"lora_decode_bs_{b}") for b in (4, 8, 40)} <= parts
    assert ("cuda_graph", "decode_bs_8") in parts  # the plain graphs, for batches without adapters


def test_loading_an_adapter_while_others_decode_changes_nothing_for_them_and_captures_nothing(setup, monkeypatch):
    base, adapters = setup
    captures = []
    original = GraphRunner._capture_bucket
    monkeypatch.setattr(GraphRunner, "_capture_bucket", lambda self, b: captures.append(b) or original(self, b))
    engine = engine_on(base)
    assert len(captures) == 2 * len(BUCKETS)
    graphs = {id(g) for r in engine.runners.all for gs in r._graphs.values() for g in gs}
    reqs = requests(4, seed=77, max_tokens=32)
    runs = []
    for late in (adapters["a"], adapters["c"]):  # "a" is loaded by then; "c" is loaded mid-decode
        engine.forget_adapters()
        seqs = [
            engine.add_request(p, params, adapter=a)
            for (p, params), a in zip(reqs[:3], [adapters["a"], None, adapters["b"]], strict=True)
        ]
        for _ in range(8):
            engine.step()
        loads = engine.stats.adapter_loads["loaded"]
        seqs.append(engine.add_request(*reqs[3], adapter=late))
        assert engine.stats.adapter_loads["loaded"] == loads + (late == adapters["c"])
        while engine.has_work():
            engine.step()
        runs.append([s.output_ids for s in seqs])
    assert runs[0][:3] == runs[1][:3]  # the running requests did not notice the load
    assert runs[1][3] != runs[0][3]  # the late request decoded with the adapter it named
    assert len(captures) == 2 * len(BUCKETS)  # only the start's; no capture on any load
    assert graphs == {id(g) for r in engine.runners.all for gs in r._graphs.values() for g in gs}


def test_compiled_lora_graphs_verify_and_apply_adapters(setup):
    """torch.compile (the default) around the LoRA kernels: every bucket compiles, captures and
    passes verification, and the adapters change what is decoded."""
    base, adapters = setup
    policy = GraphPolicy(decode_batch_buckets=(1, 4), compile=True)
    config = EngineConfig(
        model=str(base),
        max_num_seqs=4,
        max_model_len=256,
        device="cuda",
        attention_backend="triton",
        graph_policy=policy,
        lora=LoraLimits(max_loras=3, max_lora_rank=8),
    )
    engine = LLMEngine.from_config(config)[0]
    assert engine.runners.lora.compiled and engine.runners.lora.table.ready == {1, 4}
    reqs = requests(3, seed=91, max_tokens=16)
    rows = [adapters["a"], None, adapters["b"]]
    assert outputs(engine, reqs, rows) != outputs(engine, reqs, [None] * 3)
    assert engine.check_adapter(*adapters["c"])["name"] == "c"
