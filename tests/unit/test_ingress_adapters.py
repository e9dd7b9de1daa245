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


def ingress(model_name: str, lora_modules: dict[str, str]) -> SimpleNamespace:
    async def call(method, *args):
        return {"get_lora_adapters": REGISTERED, "lora_refusals": {}}[method.__name__]

    config = AppConfig.from_args(
        {"served_model_name": model_name, "lora": {"max_loras": 2}, "lora_modules": lora_modules}
    )
    fake = SimpleNamespace(
        config=config,
        model_name=model_name,
        controller=SimpleNamespace(call=call),
        _registered={},
        _registered_at=-math.inf,
        _shadowed_logged=False,
    )
    fake._adapters = Ingress._adapters.__get__(fake)
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
