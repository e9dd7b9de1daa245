"""Model configuration parsed from a Hugging Face `config.json`.

We read the raw JSON rather than `AutoConfig` so that both the v4 (`rope_scaling`, `rope_theta`)
and v5 (`rope_parameters`) spellings load, and so that an unsupported checkpoint fails here with a
message naming what is wrong, before any weight is read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.modeling.checkpoint_dir import SUPPORTED_ARCHITECTURES, CheckpointError
from workers.modeling.weight_files import stores_untied_head

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# transformers' defaults for keys a config.json may leave out (LlamaConfig, MistralConfig, Qwen2Config)
RMS_NORM_EPS = 1e-6
MISTRAL_SLIDING_WINDOW = 4096


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder; everything the model and the KV cache need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = RMS_NORM_EPS
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def tensor_shape(self, module: str, kind: str = "weight") -> tuple[int, ...]:
        """The shape of a checkpoint tensor, by the last parts of its HF name (`q_proj`, `weight`);
        a linear layer's weight is (out, in)."""
        h, v, i = self.hidden_size, self.vocab_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            ("embed_tokens", "weight"): (v, h),
            ("lm_head", "weight"): (v, h),
            ("norm", "weight"): (h,),
            ("input_layernorm", "weight"): (h,),
            ("post_attention_layernorm", "weight"): (h,),
            ("q_proj", "weight"): (q, h),
            ("k_proj", "weight"): (kv, h),
            ("v_proj", "weight"): (kv, h),
            ("q_proj", "bias"): (q,),
            ("k_proj", "bias"): (kv,),
            ("v_proj", "bias"): (kv,),
            ("o_proj", "weight"): (h, q),
            ("o_proj", "bias"): (h,),
            ("gate_proj", "weight"): (i, h),
            ("up_proj", "weight"): (i, h),
            ("down_proj", "weight"): (h, i),
        }  # fmt: skip
        return shapes[module, kind]

    def weight_bytes(self) -> int:
        """Bytes of all weights, the floor of what one decode step must read."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        embeddings = v * h * (1 if self.tie_word_embeddings else 2)
        return (self.num_layers * per_layer + embeddings + h) * torch.finfo(self.dtype).bits // 8


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of a config.json, or raise CheckpointError saying why not."""
    archs = raw.get("architectures") or []
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        found = ", ".join(archs) or f"none (model_type={raw.get('model_type')!r})"
        raise CheckpointError(f"unsupported architecture: {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[supported[0]]
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in raw
    ]
    if missing:
        raise CheckpointError(f"config.json lacks required fields: {', '.join(missing)}")
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers computes "swish" as silu
        raise CheckpointError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is supported")
    quantization = raw.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise CheckpointError(
            f"quantization_config (quant_method {method!r}): quantized checkpoints are not supported; "
            "serve the unquantized (bf16, fp16 or fp32) checkpoint"
        )

    if raw.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")

    # rope_scaling before rope_parameters, as transformers reads them: an edit that adds rope_scaling
    # to a v5 config (rope_parameters: default) extends its context
    rope = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    sliding_window = None
    if family == "mistral":
        sliding_window = raw.get("sliding_window", MISTRAL_SLIDING_WINDOW)
    elif family == "qwen2" and raw.get("use_sliding_window"):
        raise CheckpointError("Qwen2 with use_sliding_window=true (per-layer windows) is not supported")

    heads = raw["num_attention_heads"]
    kv_heads = heads if raw.get("num_key_value_heads") is None else raw["num_key_value_heads"]
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and heads > 0 and kv_heads > 0) or heads % kv_heads:
        raise CheckpointError(
            f"num_attention_heads={heads!r} and num_key_value_heads={kv_heads!r}: each key/value head must serve "
            "a whole number of attention heads"
        )
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype_name!r}; supported: {', '.join(DTYPES)}")
    return ModelConfig(
        architecture=supported[0],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", RMS_NORM_EPS),
        rope_theta=rope_theta,
        rope_scaling={} if rope_type == "default" else rope,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
        sliding_window=sliding_window,
        dtype=DTYPES[dtype_name],
        eos_token_ids=_as_tuple(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """The checkpoint's config.json, with the end-of-sequence ids of its generation_config.json
    joined to it: a chat model's end-of-turn token is often only there (Llama 3's <|eot_id|>,
    Qwen2's <|endoftext|>), and generation must stop at it as `generate` and other servers do."""
    if not Path(model_dir).is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: missing config.json")
    cfg = parse_config(_read_json(path))
    if cfg.tie_word_embeddings and stores_untied_head(Path(model_dir)):
        log.warning("%s: config.json ties the head to the embedding, but lm_head.weight differs: kept apart", model_dir)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    generation = Path(model_dir) / "generation_config.json"
    if not generation.is_file():
        return cfg
    raw = _read_json(generation)
    eos = raw.get("eos_token_id")
    if eos is not None and not (
        isinstance(eos, int) or (isinstance(eos, list) and all(isinstance(t, int) for t in eos))
    ):
        raise CheckpointError(f"{generation}: eos_token_id must be a token id or a list of them, not {eos!r}")
    extra = tuple(t for t in _as_tuple(eos) if t not in cfg.eos_token_ids)
    return dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + extra) if extra else cfg


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw
