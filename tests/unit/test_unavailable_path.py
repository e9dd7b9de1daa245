"""The engine on CPU, where CUDA graphs are unavailable: it still reaches READY and serves eager,
labels every decode part with why it ran eager, keeps per-request denial rows apart, and the
`sdpa_varlen` backend decodes like `sdpa`."""

from __future__ import annotations

import random

import pytest
import torch

from policies.dispatch import EngineState, FallbackReason
from policies.graph_policy import GraphPolicy
from tests.unit.engine_fixtures import Tiny, load_tiny, new_engine, run_sync
from workers.graphs.graph_runner import GraphRunner
from workers.kv.attention import SdpaDecode, SdpaVarlenDecode
from workers.model_runner.step_inputs import DecodeInputs
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(60)
BOS = 256
TENANT, HOLDBACK = FallbackReason.TENANT_DISABLED, FallbackReason.ROLLOUT_HOLDBACK


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


@pytest.fixture(autouse=True)
def _restore_backend(tiny):
    """Engines set the shared model's attention backend; put it back for the other tests."""
    backend = tiny.model.attention_backend
    yield
    tiny.model.attention_backend = backend


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[BOS] + [rng.randrange(256) for _ in range(n - 1)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def parts_by_key(engine: LLMEngine) -> dict[tuple[str, str, str], dict]:
    parts = engine.stats.snapshot()["decode_step_parts"]
    return {(p["execution_mode"], p["bucket_id"], p["fallback_reason"]): p for p in parts}


def decoded_rows(seqs) -> int:
    """Tokens produced by decode steps (the first token of each request comes from prefill)."""
    return sum(len(s.output_ids) - 1 for s in seqs)


def run_with_denials(engine: LLMEngine, requests, denials):
    seqs = [engine.add_request(p, sp, graph_denial=d) for (p, sp), d in zip(requests, denials)]
    for _ in range(1000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), "the engine does not finish"
    return seqs


# ---------------------------------------------------------------- default policy on CPU


def test_default_policy_on_cpu_is_ready_without_graphs(tiny, monkeypatch):
    """No CUDA: the table's global reason is unavailable, nothing is captured or verified, and
    the engine still ends READY."""

    def must_not_run(self):
        raise AssertionError("capture/verify must not run without CUDA")

    monkeypatch.setattr(GraphRunner, "capture", must_not_run)
    monkeypatch.setattr(GraphRunner, "verify", must_not_run)
    engine = new_engine(tiny, max_num_seqs=4)
    runner = engine.runner
    assert engine.config.graph_policy == GraphPolicy()
    assert runner.table.global_reason == FallbackReason.UNAVAILABLE
    assert not runner.enabled
    assert engine.state == EngineState.READY
    assert runner.table.ready == set() and runner.table.missing == {}
    assert runner._replays == {} and runner._graphs == {} and runner.records == {}
    assert not runner.compiled
    assert all(not b["ready"] for b in runner.report().values())


def test_default_policy_serves_eager_with_unavailable_labels(tiny):
    """Requests complete; every decode part is eager/none/unavailable with the engine's revision
    and backend labels; hit rate 0, fallback all 'unavailable', rows and steps add up."""
    config = EngineConfig(max_model_len=tiny.max_model_len, device="cpu", max_num_seqs=4)
    engine = LLMEngine(tiny.model, config, tiny.eos_token_ids, revision="rev-under-test")
    reqs = [(p, greedy(n)) for p, n in zip(prompts(1, [3, 9, 17]), [5, 3, 7])]
    seqs = run_sync(engine, reqs)
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [len(s.output_ids) for s in seqs] == [5, 3, 7]

    snap = engine.stats.snapshot()
    parts = snap["decode_step_parts"]
    assert parts, "no decode step was recorded"
    for p in parts:
        assert (p["execution_mode"], p["fallback_reason"], p["bucket_id"]) == ("eager", "unavailable", "none")
        assert p["model_revision"] == engine.revision == "rev-under-test"
        assert p["attention_backend"] == "sdpa"
        assert p["padding_rows"] == 0
    assert sum(p["rows"] for p in parts) == decoded_rows(seqs) == 5 - 1 + 3 - 1 + 7 - 1
    assert sum(p["steps"] for p in parts) == snap["decode_steps"] == 6
    assert snap["graph_hit_rate"] == 0.0
    assert snap["fallback_rate"] == {"unavailable": 1.0}
    assert snap["padding_waste"] == 0.0
    assert snap["steps_by_bucket"] == {"none": 6}


@pytest.mark.parametrize(
    "policy",
    [GraphPolicy(mode="eager"), GraphPolicy(capture_on_startup=False), GraphPolicy(mode="piecewise")],
    ids=["mode-eager", "no-capture-on-startup", "mode-piecewise"],
)
def test_no_cuda_trumps_policy(tiny, policy):
    """On CPU the reason is 'unavailable' whatever the policy says (not 'disabled')."""
    engine = new_engine(tiny, max_num_seqs=2, graph_policy=policy)
    assert engine.runner.table.global_reason == FallbackReason.UNAVAILABLE
    assert engine.runner.table.downgrade_reason is None
    assert engine.state == EngineState.READY
    run_sync(engine, [(prompts(2, [4])[0], greedy(3))])
    assert set(parts_by_key(engine)) == {("eager", "none", "unavailable")}


# ---------------------------------------------------------------- per-request denial


def test_denied_rows_same_tokens_and_own_labels(tiny):
    """Rows denied by tenant or rollout run in their own eager call: greedy tokens equal the same
    batch without denials, and each group is labelled with its request's reason."""
    lengths, max_tokens = [4, 11, 7, 19, 2], [6, 3, 6, 4, 5]
    reqs = [(p, greedy(n)) for p, n in zip(prompts(3, lengths), max_tokens)]
    denials = [None, TENANT, None, HOLDBACK, TENANT]

    plain = run_with_denials(new_engine(tiny, max_num_seqs=5), reqs, [None] * 5)
    engine = new_engine(tiny, max_num_seqs=5)
    denied = run_with_denials(engine, reqs, denials)

    expected = [s.output_ids for s in plain]
    assert len({tuple(o) for o in expected}) == 5, "prompts must give distinct outputs for this test to bite"
    assert [s.output_ids for s in denied] == expected

    parts = parts_by_key(engine)
    assert set(parts) == {
        ("eager", "none", "unavailable"),
        ("eager", "none", "tenant_disabled"),
        ("eager", "none", "rollout_holdback"),
    }
    rows = {key[2]: p["rows"] for key, p in parts.items()}
    steps = {key[2]: p["steps"] for key, p in parts.items()}
    assert rows == {"unavailable": 5 + 5, "tenant_disabled": 2 + 4, "rollout_holdback": 3}
    assert steps == {"unavailable": 5, "tenant_disabled": 4, "rollout_holdback": 3}
    assert sum(rows.values()) == decoded_rows(denied)
    snap = engine.stats.snapshot()
    assert snap["graph_hit_rate"] == 0.0
    total = decoded_rows(denied)
    assert snap["fallback_rate"] == pytest.approx(
        {"unavailable": 10 / total, "tenant_disabled": 6 / total, "rollout_holdback": 3 / total}
    )


def test_all_rows_denied(tiny):
    """A batch where every request is denied never asks the table: only tenant_disabled parts."""
    reqs = [(p, greedy(4)) for p in prompts(4, [5, 8])]
    expected = [s.output_ids for s in run_with_denials(new_engine(tiny, max_num_seqs=2), reqs, [None, None])]
    engine = new_engine(tiny, max_num_seqs=2)
    seqs = run_with_denials(engine, reqs, [TENANT, TENANT])
    assert [s.output_ids for s in seqs] == expected
    parts = parts_by_key(engine)
    assert set(parts) == {("eager", "none", "tenant_disabled")}
    assert parts[("eager", "none", "tenant_disabled")]["rows"] == decoded_rows(seqs) == 6
    assert engine.stats.snapshot()["fallback_rate"] == {"tenant_disabled": 1.0}


# ---------------------------------------------------------------- attention backends


def test_sdpa_varlen_matches_sdpa(tiny):
    """Greedy tokens of a batch of different lengths are the same with either backend, and one
    decode step's logits agree while varlen really reads fewer key positions."""
    reqs = [(p, greedy(8)) for p in prompts(5, [2, 13, 6, 30])]
    sdpa = run_sync(new_engine(tiny, max_num_seqs=4), reqs)
    varlen_engine = new_engine(tiny, max_num_seqs=4, attention_backend="sdpa_varlen")
    assert varlen_engine.runner.backend.name == "sdpa_varlen"
    assert varlen_engine.runner.table.global_reason == FallbackReason.UNAVAILABLE
    varlen = run_sync(varlen_engine, reqs)
    assert [s.output_ids for s in varlen] == [s.output_ids for s in sdpa]
    labels = {p["attention_backend"] for p in varlen_engine.stats.snapshot()["decode_step_parts"]}
    assert labels == {"sdpa_varlen"}

    engine = new_engine(tiny, max_num_seqs=4)
    for p, sp in reqs:
        engine.add_request(p, sp)
    engine.step()  # prefill + one decode: the cache holds each row's keys
    tokens, positions, slots, _ = DecodeInputs.of(list(engine.scheduler.running.values())).to_device(engine.device)
    model = tiny.model
    with torch.inference_mode():
        model.attention_backend = SdpaDecode()
        full = model.decode(tokens, positions, slots, engine.cache)
        model.attention_backend = SdpaVarlenDecode()
        meta = model.attention_backend.prepare(engine.cache, positions, model.cfg.sliding_window)
        short = model.decode(tokens, positions, slots, engine.cache)
    page = engine.cache.page_size
    assert meta.shape[-1] == -(-(int(positions.max()) + 1) // page) * page < tiny.max_model_len
    torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-5)


def test_unknown_backend_rejected(tiny):
    with pytest.raises(ValueError, match="flash_decode") as exc:
        new_engine(tiny, attention_backend="flash_decode")
    assert "sdpa" in str(exc.value) and "sdpa_varlen" in str(exc.value)
