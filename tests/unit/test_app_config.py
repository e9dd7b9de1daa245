"""The application config and the secret handling around it (pure Python; no Ray needed)."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app import auth
from app.config import AppConfig, parse_api_keys
from app.replica import fit_max_tokens
from workers.sampling import InvalidRequest


def test_the_shipped_serve_config_is_a_valid_app_config():
    """config/graphserve.yaml's args are exactly what AppConfig accepts."""
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "config" / "graphserve.yaml").read_text())
    config = AppConfig.from_args(raw["applications"][0]["args"])
    assert raw["applications"][0]["import_path"] == "app:deployment"
    assert config.cuda_graph_policy.decode_batch_buckets == (1, 2, 4, 8, 16, 32)


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


def test_tenant_lookup_and_admin_token():
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    assert auth.tenant_for("key-b", keys) == "tenant-b"
    assert auth.tenant_for("key-c", keys) is None and auth.tenant_for(None, keys) is None
    assert auth.tenant_for(None, {}) == auth.OPEN_TENANT  # no keys configured: open, tenant `default`
    assert auth.bearer("Bearer abc") == "abc" and auth.bearer("Basic abc") is None and auth.bearer(None) is None
    assert auth.admin_ok("tok", "tok") and not auth.admin_ok("tok2", "tok") and not auth.admin_ok(None, "tok")


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
