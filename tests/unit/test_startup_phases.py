"""Start-up phases: an engine built from its config reports how long it took to load, allocate,
compile, capture, verify and warm up; each phase is non-negative, together they fit in the total,
and the READY log line says it once."""

from __future__ import annotations

import logging

import pytest

import workers.serving.engine
from policies.graph_policy import GraphPolicy
from tests.unit.engine_fixtures import TINY_MAX_MODEL_LEN, Tiny, load_tiny
from tests.unit.graph_faults import EagerGraphRunner
from workers.serving.engine import LLMEngine
from workers.serving.engine_config import EngineConfig
from workers.serving.startup import PHASES, StartupClock


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    return load_tiny(tmp_path_factory)


def check_phases(startup: dict) -> dict[str, float]:
    phases = startup["phases"]
    assert set(phases) == set(PHASES)
    assert all(s >= 0 for s in phases.values()), phases
    assert sum(phases.values()) <= startup["total_s"]
    return phases


@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs"])
def test_an_engine_reports_its_startup_phases_and_logs_them_once(tiny, graphs, monkeypatch, caplog):
    monkeypatch.setenv("GRAPHSERVE_CACHE", str(tiny.cache))
    if graphs:  # the CPU stand-in for capture: capture and verify run their real bookkeeping
        monkeypatch.setattr(workers.serving.engine, "GraphRunner", EagerGraphRunner)
    policy = GraphPolicy(decode_batch_buckets=(1, 2), compile=False)
    config = EngineConfig(max_model_len=TINY_MAX_MODEL_LEN, max_num_seqs=2, device="cpu", graph_policy=policy)
    with caplog.at_level(logging.INFO, logger="workers.serving.engine"):
        engine, _ = LLMEngine.from_config(config)
    startup = engine.status().startup
    phases = check_phases(startup)
    assert phases["load"] > 0 and phases["warmup"] > 0 and phases["compile"] == 0
    assert (phases["capture"] > 0 and phases["verify"] > 0) == graphs
    assert startup["compiled_graphs"] == 0
    assert set(startup["first_call_s"]) == ({"1", "2"} if graphs else {"1"}) and all(
        s >= 0 for s in startup["first_call_s"].values()
    )
    assert engine.status().as_dict()["startup"] == startup
    ready = [r.getMessage() for r in caplog.records if "engine READY" in r.getMessage()]
    assert len(ready) == 1 and f"{startup['total_s']:.1f} s" in ready[0], ready


def test_the_clock_adds_phases_timed_elsewhere_and_counts_load_before_it():
    clock = StartupClock(load_s=2.0)
    with clock.phase("allocate"):
        pass
    clock.add({"capture": 0.5})
    clock.add({"capture": 0.25})
    clock.stop()
    report = clock.report()
    assert report["phases"]["load"] == 2.0 and report["phases"]["capture"] == 0.75
    assert report["total_s"] >= 2.0  # started before the load it was told of
    with pytest.raises(KeyError):
        clock.add({"lunch": 1.0})
