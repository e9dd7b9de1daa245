"""The application config and the secret handling around it (pure Python; no Ray needed)."""

import logging
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app import auth
from app.config import AppConfig, admin_tokens_from_env, api_keys_from_env, parse_admin_tokens, parse_api_keys
from app.replica import engine_config, fit_max_tokens
from workers.serving.sampling import InvalidRequest


def test_the_shipped_serve_config_is_a_valid_app_config():
    """config/graphserve.yaml's args are exactly what AppConfig accepts."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "graphserve.yaml").read_text())
    config = AppConfig.from_args(raw["applications"][0]["args"])
    assert raw["applications"][0]["import_path"] == "app:deployment"
    assert config.cuda_graph_policy.decode_batch_buckets is None  # the ladder that follows max_num_seqs
    assert config.on_device(gpu=True).max_num_seqs == 256 and config.on_device(gpu=False).max_num_seqs == 32
    assert config.on_device(gpu=True).accelerator == "gpu" and config.attention_backend == "auto"


def test_the_prefill_delay_follows_the_accelerator_unless_set():
    """Gathering arrivals pays on a GPU, where a step is shorter than the delay (prefill_waves_h200.md)."""
    assert AppConfig().on_device(gpu=True).max_prefill_delay_ms == 8.0
    assert AppConfig().on_device(gpu=False).max_prefill_delay_ms == 0.0
    set_to = AppConfig.from_args({"max_prefill_delay_ms": 3})
    assert (
        set_to.on_device(gpu=True).max_prefill_delay_ms == 3 and set_to.on_device(gpu=False).max_prefill_delay_ms == 3
    )
    with pytest.raises(ValidationError, match="max_prefill_delay_ms"):
        AppConfig.from_args({"max_prefill_delay_ms": -1})


def test_unknown_and_invalid_fields_are_named():
    with pytest.raises(ValidationError, match="max_num_sequences"):
        AppConfig.from_args({"max_num_sequences": 4})
    with pytest.raises(ValidationError, match="decode_batch_buckets"):
        AppConfig.from_args({"cuda_graph_policy": {"decode_batch_buckets": [8, 4]}})


def test_policy_file_replaces_the_inline_policy(tmp_path):
    """On Kubernetes the policy comes from a mounted ConfigMap file; it wins over args."""
    path = tmp_path / "graph-policy.yaml"
    path.write_text("cuda_graph_policy:\n  mode: piecewise\n  decode_batch_buckets: [1, 3]\n")
    config = AppConfig.from_args({"cuda_graph_policy": {"mode": "full"}, "cuda_graph_policy_file": str(path)})
    assert config.graph_policy().mode == "piecewise"
    assert config.graph_policy().decode_batch_buckets == (1, 3)
    assert AppConfig.from_args({"cuda_graph_policy": {"mode": "eager"}}).graph_policy().mode == "eager"


def test_api_keys_parse_and_malformed_entries_never_echo_the_secret():
    assert parse_api_keys("tenant-a:key-a, tenant-b:key-b") == {"key-a": "tenant-a", "key-b": "tenant-b"}
    assert parse_api_keys("") == {} and parse_api_keys(None) == {}
    with pytest.raises(ValueError) as info:
        parse_api_keys("tenant-a:key-a,s3cr3t-without-tenant")
    assert "#2" in str(info.value) and "s3cr3t" not in str(info.value)


def test_api_keys_without_the_spaces_around_their_parts_and_each_key_once():
    """`tenant-a: key-a` is key `key-a` (a client's bearer token is read without spaces, so a key
    kept with one could never match); a tenant may hold several keys, but a key given twice is
    refused by position (the second would silently take the first's tenant)."""
    assert parse_api_keys(" tenant-a : key-a,tenant-b: key-b ") == {"key-a": "tenant-a", "key-b": "tenant-b"}
    assert parse_api_keys("tenant-a:old,tenant-a:new") == {"old": "tenant-a", "new": "tenant-a"}
    with pytest.raises(ValueError) as info:
        parse_api_keys("tenant-a:s3cr3t,tenant-c:other,tenant-b:s3cr3t")
    assert "entry #3 has the same key as entry #1" in str(info.value) and "s3cr3t" not in str(info.value)
    with pytest.raises(ValueError, match="#1 is not of the form"):
        parse_api_keys("tenant-a:  ")


def test_tenant_lookup_and_admin_operator():
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    assert auth.tenant_for("key-b", keys) == "tenant-b"
    assert auth.tenant_for("key-c", keys) is None and auth.tenant_for(None, keys) is None
    assert auth.tenant_for(None, {}) == auth.OPEN_TENANT  # no keys configured: open, tenant `default`
    assert auth.bearer("Bearer abc") == "abc" and auth.bearer("Basic abc") is None and auth.bearer(None) is None
    tokens = {"tok-1": "alice", "tok-2": "bob"}
    assert auth.admin_operator("tok-2", tokens) == "bob" and auth.admin_operator("tok-1", tokens) == "alice"
    assert auth.admin_operator("tok-", tokens) is None and auth.admin_operator("tok-22", tokens) is None
    assert auth.admin_operator(None, tokens) is None and auth.admin_operator("", {"": "nobody"}) is None


def test_every_admin_token_is_compared(monkeypatch):
    """The match is found by comparing against every token in constant time, never stopping at the
    first match, so timing tells nothing about which token (or how much of one) was right."""
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    tokens = {f"tok-{i}": f"op-{i}" for i in range(5)}
    assert auth.admin_operator("tok-0", tokens) == "op-0"
    assert sorted(compared) == sorted(t.encode() for t in tokens)


def test_admin_tokens_parse():
    assert parse_admin_tokens("alice:tok1, bob:tok:2") == {"tok1": "alice", "tok:2": "bob"}
    assert parse_admin_tokens("alice:tok1", single="root-tok") == {"root-tok": "admin", "tok1": "alice"}
    assert parse_admin_tokens(None, single="root-tok") == {"root-tok": "admin"}
    assert parse_admin_tokens("", None) == {} and parse_admin_tokens(" , ") == {}
    assert parse_admin_tokens("alice : tok1, bob: tok2") == {"tok1": "alice", "tok2": "bob"}


@pytest.mark.parametrize(
    ("raw", "single", "needle"),
    [
        ("alice:s3cr3t-1,s3cr3t-2", None, "entry #2 is not of the form name:token"),
        ("alice:s3cr3t-1,:s3cr3t-2", None, "entry #2 is not of the form name:token"),
        ("alice:", None, "entry #1 is not of the form name:token"),
        ("al ice:s3cr3t-1", None, "entry #1: a name may hold only"),
        ("alice:s3cr3t-1,bob:s3cr3t-2,alice:s3cr3t-3", None, "entry #3 has the same name as entry #1"),
        ("alice:s3cr3t-1,bob:s3cr3t-1", None, "entry #2 has the same token as entry #1"),
        ("admin:s3cr3t-1", "s3cr3t-0", "entry #1 has the same name as the single admin token"),
        ("alice:s3cr3t-0", "s3cr3t-0", "entry #1 has the same token as the single admin token"),
    ],
    ids=["no-colon", "no-name", "no-token", "bad-name", "name-twice", "token-twice", "admin-twice", "single-twice"],
)
def test_malformed_admin_tokens_are_refused_by_position_never_content(raw, single, needle):
    with pytest.raises(ValueError) as info:
        parse_admin_tokens(raw, single)
    assert needle in str(info.value)
    assert "s3cr3t" not in str(info.value)


def test_admin_tokens_from_the_environment(monkeypatch):
    """Both variables, by the names the config gives; an admin token that is also a tenant's API
    key is refused (that tenant would be an operator)."""
    config = AppConfig.from_args({"admin_tokens_env": "OPS_TOKENS", "admin_token_env": "OPS_TOKEN"})
    monkeypatch.setenv("OPS_TOKENS", "alice:tok1,bob:tok2")
    monkeypatch.setenv("OPS_TOKEN", "tok0")
    monkeypatch.setenv("GRAPHSERVE_ADMIN_TOKENS", "mallory:ignored")
    assert admin_tokens_from_env(config) == {"tok0": "admin", "tok1": "alice", "tok2": "bob"}
    monkeypatch.setenv("OPS_TOKEN", "tok0\n")  # as a secret file's line reaches the environment
    assert admin_tokens_from_env(config)["tok0"] == "admin"
    monkeypatch.setenv("OPS_TOKEN", "")
    assert admin_tokens_from_env(config) == {"tok1": "alice", "tok2": "bob"}
    monkeypatch.delenv("OPS_TOKENS")
    assert admin_tokens_from_env(config) == {}
    monkeypatch.setenv("OPS_TOKENS", "alice:key-a")
    monkeypatch.setenv("GRAPHSERVE_API_KEYS", "tenant-a:key-a")
    with pytest.raises(ValueError, match="also an API key in GRAPHSERVE_API_KEYS") as info:
        admin_tokens_from_env(config)
    assert "key-a" not in str(info.value)


SECRET = "s3cr3t-alice-token-0123456789"


@pytest.mark.parametrize(
    ("authorization", "tokens", "status", "reason"),
    [
        (None, {SECRET: "alice"}, 401, "missing"),
        ("Basic " + SECRET, {SECRET: "alice"}, 401, "missing"),
        ("Bearer " + SECRET[:-1], {SECRET: "alice"}, 403, "wrong"),
        ("Bearer " + SECRET + "x", {SECRET: "alice"}, 403, "wrong"),
        ("Bearer " + SECRET, {}, 403, "disabled"),
    ],
    ids=["none", "basic", "prefix", "longer", "disabled"],
)
def test_refused_admin_calls_are_logged_without_the_token(caplog, authorization, tokens, status, reason):
    """A refusal says why to the client (4xx JSON detail) and logs client, path and reason; neither
    carries the token or any part of it."""
    with caplog.at_level(logging.WARNING, logger="app.auth"):
        refusal = auth.authorize_admin(authorization, tokens, "set X to enable it", "10.1.2.3", "/admin/status")
    assert isinstance(refusal, auth.AdminRefusal)
    assert refusal.status == status and refusal.reason == reason and refusal.detail
    (record,) = caplog.records
    message = record.getMessage()
    assert f"reason={reason}" in message and "client=10.1.2.3" in message and "/admin/status" in message
    for text in (message, refusal.detail):
        assert not any(SECRET[i : i + 6] in text for i in range(len(SECRET) - 5)), text


def test_an_accepted_admin_call_names_its_operator_and_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="app.auth"):
        who = auth.authorize_admin("Bearer " + SECRET, {"other": "bob", SECRET: "alice"}, "", "10.1.2.3", "/admin")
    assert who == auth.Operator("alice", "10.1.2.3") and not caplog.records


def test_min_replicas_zero_is_refused_with_the_reason():
    """Scale-to-zero can never scale up again here (the ingress answers 503 before routing while no
    replica is READY), so 0 is refused, naming the field and why."""
    with pytest.raises(ValidationError) as info:
        AppConfig.from_args({"autoscaling": {"min_replicas": 0}})
    message = str(info.value)
    assert "autoscaling.min_replicas" in message and "503" in message and "scale up" in message
    with pytest.raises(ValidationError, match="must not exceed max_replicas"):
        AppConfig.from_args({"autoscaling": {"min_replicas": 3, "max_replicas": 2}})
    assert AppConfig.from_args({"autoscaling": {"min_replicas": 1, "max_replicas": 1}}).autoscaling.min_replicas == 1


def test_max_tokens_follows_openai_rules():
    """Prompt + max_tokens must fit the context (else 400); defaults fit the room left."""
    assert fit_max_tokens("completion", None, 10, 256) == 16
    assert fit_max_tokens("completion", None, 250, 256) == 6
    assert fit_max_tokens("chat", None, 10, 256) == 246
    assert fit_max_tokens("chat", 100, 10, 256) == 100
    with pytest.raises(InvalidRequest, match="max_model_len=256"):
        fit_max_tokens("completion", 247, 10, 256)
    with pytest.raises(InvalidRequest, match="no room"):
        fit_max_tokens("chat", None, 256, 256)
    with pytest.raises(InvalidRequest, match="^max_completion_tokens=247 plus") as info:  # as the client named it
        fit_max_tokens("chat", 247, 10, 256, "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


def test_lora_config_reaches_the_engine_and_bad_lora_settings_are_named():
    from app.replica import engine_config

    assert engine_config(AppConfig.from_args({})).lora is None  # absent: LoRA off
    config = AppConfig.from_args(
        {
            "lora": {"max_loras": 4, "max_lora_rank": 16, "target_modules": ["q_proj"]},
            "lora_modules": {"sql-v1": "/adapters/sql"},
        }
    )
    limits = engine_config(config).lora
    assert (limits.max_loras, limits.max_lora_rank, limits.target_modules) == (4, 16, ("q_proj",))
    assert AppConfig.from_args({"lora": {}}).lora.max_loras == 8
    with pytest.raises(ValidationError, match="lora_modules needs lora"):
        AppConfig.from_args({"lora_modules": {"sql": "/adapters/sql"}})
    with pytest.raises(ValidationError, match="adapter name 'a/b'"):
        AppConfig.from_args({"lora": {}, "lora_modules": {"a/b": "/adapters/sql"}})
    with pytest.raises(ValidationError, match="adapter 'my-model' has the served model's name"):
        AppConfig.from_args({"lora": {}, "served_model_name": "my-model", "lora_modules": {"my-model": "/a"}})
    with pytest.raises(ValidationError, match="target_modules"):
        AppConfig.from_args({"lora": {"target_modules": ["embed_tokens"]}})
    with pytest.raises(ValidationError, match="max_lora_rank"):
        AppConfig.from_args({"lora": {"max_lora_rank": 0}})


def test_long_prefill_token_threshold_reaches_the_engine():
    from app.replica import engine_config

    assert engine_config(AppConfig.from_args({})).long_prefill_token_threshold == 0  # off by default
    config = AppConfig.from_args({"long_prefill_token_threshold": 1024})
    assert engine_config(config).long_prefill_token_threshold == 1024
    with pytest.raises(ValidationError, match="long_prefill_token_threshold"):
        AppConfig.from_args({"long_prefill_token_threshold": -1})


def test_a_decode_bucket_beyond_max_num_seqs_is_refused_naming_it():
    """A bucket the batch can never reach would only allocate (10^9 rows tried 32 GB): refused,
    in the config and by PUT /admin/graph-policy (`GraphPolicy.check_fits`)."""
    with pytest.raises(ValidationError, match=r"decode_batch_buckets: \[64\] above max_num_seqs=32"):
        AppConfig.model_validate({"max_num_seqs": 32, "cuda_graph_policy": {"decode_batch_buckets": [1, 8, 64]}})
    AppConfig.model_validate({"max_num_seqs": 64, "cuda_graph_policy": {"decode_batch_buckets": [1, 8, 64]}})
    many = {"max_num_seqs": 8, "cuda_graph_policy": {"decode_batch_buckets": list(range(1, 100_001))}}
    with pytest.raises(ValidationError, match=r"\[9, 10, 11, 12, 13, 14, 15, 16\] and 99984 more above") as info:
        AppConfig.model_validate(many)
    assert len(str(info.value)) < 2000  # the list is not echoed back


def test_a_bucket_beyond_the_devices_batch_limit_or_in_a_policy_file_is_refused_before_any_start(tmp_path):
    """With max_num_seqs left to the device (32 on CPU) a bucket of 10^9 passed the builder and failed
    in every replica; in a policy file it passed everywhere and a replica sized inputs for 10^9 rows."""
    config = AppConfig.from_args({"cuda_graph_policy": {"decode_batch_buckets": [1, 1_000_000_000]}})
    with pytest.raises(ValueError, match=r"decode_batch_buckets: \[1000000000\] above max_num_seqs=32"):
        config.on_device(gpu=False)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"cuda_graph_policy": {"decode_batch_buckets": [1, 2, 100_000_000]}}))
    in_file = AppConfig.from_args({"max_num_seqs": 4, "cuda_graph_policy_file": str(path)})
    with pytest.raises(ValueError, match=r"decode_batch_buckets: \[100000000\] above max_num_seqs=4"):
        engine_config(in_file)
    missing = AppConfig.from_args({"cuda_graph_policy_file": str(tmp_path / "none.yaml")})
    with pytest.raises(ValueError, match="cuda_graph_policy_file .*none.yaml"):
        missing.graph_policy()


def test_command_line_values_reach_sections_lists_and_null():
    """`serve run app:deployment k=v` passes every value as a string: dotted keys, JSON for fields
    that take no text, and null were all refused, though the docs say the same keys work there."""
    config = AppConfig.from_args(
        {
            "lora.max_loras": "4",
            "cuda_graph_policy.mode": "eager",
            "cuda_graph_policy.compile": "false",
            "cuda_graph_policy.decode_batch_buckets": "[1, 2, 4]",
            "cors_allowed_origins": '["*"]',
            "autoscaling": '{"max_replicas": 3}',
            "tenants.tenant-a.cuda_graph": "false",
            "max_num_seqs": "null",
            "dtype": "null",
            "model": "null",
            "served_model_name": "123",
            "enable_prefix_caching": "false",
        }
    )
    assert (config.lora.max_loras, config.cuda_graph_policy.mode, config.cuda_graph_policy.compile) == (
        4,
        "eager",
        False,
    )
    assert config.cuda_graph_policy.decode_batch_buckets == (1, 2, 4) and config.cors_allowed_origins == ["*"]
    assert config.autoscaling.max_replicas == 3 and not config.tenants["tenant-a"].cuda_graph
    assert (config.max_num_seqs, config.dtype, config.model, config.served_model_name) == (None, None, None, "123")
    assert not config.enable_prefix_caching
    with pytest.raises(ValidationError, match="max_model_length"):
        AppConfig.from_args({"max_model_length": "4096"})


def test_autoscaling_sections_take_only_serves_keys_and_keep_their_own_defaults():
    """A typo inside `autoscaling` went to Serve, which dropped it; a partial ingress section took
    the LLM replicas' defaults for the rest (a target of 24 instead of 128, a max of 2)."""
    with pytest.raises(ValidationError, match=r"unknown keys \['max_replica'\]"):
        AppConfig.from_args({"autoscaling": {"max_replica": 3}})
    assert AppConfig.from_args({"autoscaling": {"upscale_delay_s": 5}}).autoscaling.model_extra == {
        "upscale_delay_s": 5
    }
    ingress = AppConfig.from_args({"ingress_autoscaling": {"max_replicas": 3}}).ingress_autoscaling
    assert (ingress.min_replicas, ingress.max_replicas, ingress.target_ongoing_requests) == (1, 3, 128)
    assert AppConfig.from_args({"ingress_autoscaling": {"min_replicas": 3}}).ingress_autoscaling.max_replicas == 4


def test_an_autoscaling_target_a_replica_cannot_reach_is_refused_and_the_default_lowered():
    """A replica takes max_num_seqs + max_waiting requests: with a target above that Serve never
    scaled out (a probe: max_num_seqs 2, max_waiting 1, target 24: bursts got 503s at capacity and
    the deployment stayed at one replica). Checked once the device's batch limit is known; the
    default target (24) is lowered to what a replica takes, so small limits still start."""
    args = {"max_num_seqs": "2", "max_waiting": "1", "autoscaling": {"max_replicas": 2, "target_ongoing_requests": 24}}
    with pytest.raises(ValueError, match=r"target_ongoing_requests \(24\) is above .* = 3\)"):
        AppConfig.from_args(args).on_device(False)
    small = AppConfig.from_args({"max_num_seqs": "2", "max_waiting": "1"}).on_device(False)
    assert small.autoscaling.target_ongoing_requests == 3 and small.autoscaling.max_replicas == 2
    fixed = {**args, "autoscaling": {"max_replicas": 1, "target_ongoing_requests": 24}}
    assert AppConfig.from_args(fixed).on_device(False).autoscaling.target_ongoing_requests == 24  # nothing to add
    assert AppConfig.from_args({}).on_device(True).autoscaling.target_ongoing_requests == 24  # the defaults


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"model": ""}, "names no checkpoint"),
        ({"model": "."}, "names no checkpoint"),
        ({"controller_namespace": ""}, "controller_namespace"),
        ({"kv_page_size": 100000}, "kv_page_size 100000 is above max_model_len 2048"),
        ({"max_num_seqs": 100_000_000}, "max_num_seqs"),
    ],
)
def test_values_that_failed_late_or_silently_are_refused_naming_the_key(args, needle):
    with pytest.raises(ValidationError, match=needle):
        AppConfig.from_args(args)


def test_secrets_a_line_each_and_a_set_but_empty_list(monkeypatch):
    """A multi-line secret (one entry a line) parsed as one unusable entry; a variable that is set
    but holds no entry (a secret that did not mount) left the API open without a word."""
    assert parse_api_keys("a:k1\nb:k2\r\n") == {"k1": "a", "k2": "b"}
    assert parse_admin_tokens("alice:t1\nbob:t2") == {"t1": "alice", "t2": "bob"}
    for empty in ("", "   ", ",,,", "\n"):
        monkeypatch.setenv("GRAPHSERVE_API_KEYS", empty)
        with pytest.raises(ValueError, match="GRAPHSERVE_API_KEYS is set but holds no tenant:key entry"):
            api_keys_from_env(AppConfig())
    monkeypatch.delenv("GRAPHSERVE_API_KEYS")
    assert api_keys_from_env(AppConfig()) == {}


@pytest.mark.parametrize(
    "policy",
    [
        {"decode_batch_buckets": ["1", "2"]},
        {"decode_batch_buckets": [1.0, 2.0]},
        {"capture_prefill": "yes"},
        {"max_cached_graphs": True},
        {"shadow_verify_every_n_steps": False},
        {"graph_memory_budget_mb": 1e308},
    ],
)
def test_graph_policy_values_are_taken_only_in_their_own_type_and_range(policy):
    """No coercion (true is not 1 graph, false is not 'shadow verification off') and no unbounded
    memory budget: each is a 400 naming the field at PUT /admin/graph-policy."""
    from policies.graph_policy import GraphPolicy

    with pytest.raises(ValidationError, match=next(iter(policy))):
        GraphPolicy.model_validate(policy)


def test_lora_modules_without_an_adapter_are_named(tmp_path):
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    config = AppConfig.from_args(
        {"lora": {"max_loras": 2}, "lora_modules": {"sql": str(tmp_path / "sql"), "x": str(tmp_path / "none")}}
    )
    with pytest.raises(ValueError, match=r"lora_modules: \{'x': '.*none'\} hold no adapter_config.json"):
        config.check_lora_modules()


def test_the_adapters_served_are_the_registered_bar_the_models_name_and_the_configs_over_them():
    config = AppConfig.from_args(
        {"served_model_name": "base", "lora": {"max_loras": 2}, "lora_modules": {"sql": "/config/sql"}}
    )
    registered = {"sql": {"path": "/admin/sql"}, "chat": {"path": "/admin/chat"}, "base": {"path": "/admin/base"}}
    assert config.served_adapters(registered) == {"sql": "/config/sql", "chat": "/admin/chat"}
