"""Which adapters the ingress serves and lists (no Ray: its methods on a stand-in): those registered
through the admin API and kept by the controller across restarts meet a configuration that may
have changed since."""

from __future__ import annotations

import asyncio
import logging
import math
from types import SimpleNamespace

from app.config import AppConfig
from app.ingress import Ingress

REGISTERED = {
    "foo": {"path": "/adapters/foo", "added_by": "alice", "added_at": 1.0},
    "sql": {"path": "/adapters/sql-admin", "added_by": "bob", "added_at": 2.0},
    "chat": {"path": "/adapters/chat", "added_by": "carol", "added_at": 3.0},
}


def ingress(model_name: str, lora_modules: dict[str, str], call=None) -> SimpleNamespace:
    async def registry(method, *args):
        return {"get_lora_adapters": REGISTERED, "lora_refusals": {}}[method.__name__]

    config = AppConfig.from_args(
        {"served_model_name": model_name, "lora": {"max_loras": 2}, "lora_modules": lora_modules}
    )
    fake = SimpleNamespace(
        config=config,
        model_name=model_name,
        controller=SimpleNamespace(call=call or registry),
        _registered={},
        _registered_at=-math.inf,
        _reads=0,
        _read_held=0,
        _changed_at_read=0,
        _shadowed_logged=False,
    )
    fake._adapters = Ingress._adapters.__get__(fake)
    fake._registry_changed = Ingress._registry_changed.__get__(fake)
    return fake


def test_an_admin_adapter_with_the_served_models_name_is_not_served_under_it(caplog):
    """Registered as `foo`, then the deployment restarted with served_model_name foo: /v1/models
    listed two cards with id `foo` (the model, and the adapter whose requests the model served)."""
    fake = ingress("foo", {})
    with caplog.at_level(logging.WARNING):
        served = asyncio.run(fake._adapters())
        asyncio.run(fake._adapters())
    assert served == {"sql": "/adapters/sql-admin", "chat": "/adapters/chat"}
    assert [r.message for r in caplog.records if "served model's name" in r.message] == [
        "adapter 'foo', registered through the admin API, has the served model's name: the model is served "
        "under it (DELETE /admin/lora-adapters/foo removes the registration)"
    ]  # once, not at every read of the registry


def test_the_configs_adapter_wins_over_an_admin_one_of_its_name():
    served = asyncio.run(ingress("base", {"sql": "/adapters/sql-config"})._adapters())
    assert served == {"foo": "/adapters/foo", "sql": "/adapters/sql-config", "chat": "/adapters/chat"}


def test_a_read_begun_before_an_add_does_not_hide_the_added_adapter():
    """A request's read of the registry, begun before an admin add and ending after it, held the
    old registry as current: the added adapter was a 404 right after its 201 (seen in CI under
    load). Here that read ends last, after a newer one: the newer answer stays, and stays current."""
    before, after = {"foo": REGISTERED["foo"]}, {**REGISTERED}
    registry, release, stalled = [before], asyncio.Event(), []

    async def call(method, *args):
        if method.__name__ == "lora_refusals":
            return {}
        answer = registry[0]
        if not stalled:  # the first read: it waits, holding the registry as it was when it asked
            stalled.append(True)
            await release.wait()
        return answer

    async def scenario() -> tuple[dict, dict]:
        fake = ingress("base", {}, call)
        old_read = asyncio.create_task(fake._adapters())
        await asyncio.sleep(0)  # it has asked
        registry[0] = after  # the add, through this ingress
        fake._registry_changed()
        fresh = await fake._adapters()
        release.set()
        await old_read
        return fresh, await fake._adapters()

    fresh, later = asyncio.run(scenario())
    assert "sql" in fresh and "chat" in fresh
    assert later == fresh
