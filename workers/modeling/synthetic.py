"""Models made here rather than downloaded: the embedded tiny model's checkpoint and byte-level
tokenizer, benchmark models of real shapes (Llama-3.2-1B and Llama-3.1-8B) with random weights
(speed does not depend on the values), and random LoRA adapters in PEFT's format.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from workers.modeling.config import ModelConfig, parse_config
from workers.modeling.model import LlamaModel
from workers.modeling.parallel import TPGroup
from workers.modeling.token_bytes import byte_level_chars

TINY_SEED = 1234
SPECIAL_TOKENS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
BENCH_CONFIGS: dict[str, dict] = {
    "1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_parameters={**_LLAMA3_ROPE, "factor": 32.0},
        dtype="bfloat16",
    ),
    "8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_parameters={**_LLAMA3_ROPE, "factor": 8.0},
        dtype="bfloat16",
    ),
}


def build_byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token, plus chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in enumerate(byte_level_chars())}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_hf_config(vocab_size: int) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
        bos_token_id=vocab_size - 5,
        eos_token_id=vocab_size - 4,
    )


def random_state_dict(cfg: ModelConfig, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """HF-named random weights, on the host (made on `device`: a GPU makes 8B of them in seconds).
    The output head is scaled up so greedy choices are clear-cut."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(cfg.dtype).cpu()

    sd = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0), "model.norm.weight": 1 + rand(h)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = rand(cfg.vocab_size, h, std=0.5)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = 1 + rand(h)
        sd[p + "post_attention_layernorm.weight"] = 1 + rand(h)
        sd[p + "self_attn.q_proj.weight"] = rand(cfg.num_heads * d, h, std=0.2)
        sd[p + "self_attn.k_proj.weight"] = rand(cfg.num_kv_heads * d, h, std=0.2)
        sd[p + "self_attn.v_proj.weight"] = rand(cfg.num_kv_heads * d, h, std=0.2)
        sd[p + "self_attn.o_proj.weight"] = rand(h, cfg.num_heads * d, std=0.1)
        if cfg.qkv_bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                rows = (cfg.num_heads if name == "q_proj" else cfg.num_kv_heads) * d
                sd[p + f"self_attn.{name}.bias"] = rand(rows, std=0.1)
        sd[p + "mlp.gate_proj.weight"] = rand(i, h, std=0.1)
        sd[p + "mlp.up_proj.weight"] = rand(i, h, std=0.1)
        sd[p + "mlp.down_proj.weight"] = rand(h, i, std=0.1)
    return sd


def write_checkpoint(
    path: Path, hf_config: dict, tokenizer, seed: int, max_shard_tensors: int = 0, device: str = "cpu"
) -> Path:
    """Write a real checkpoint directory: config.json through transformers, safetensors weights
    (sharded with an index when max_shard_tensors > 0, made on `device`), and the tokenizer via
    save_pretrained."""
    import json

    from transformers import AutoConfig

    cfg = parse_config(hf_config)
    model_type = hf_config["model_type"]
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "dtype")}
    hf = AutoConfig.for_model(model_type, **fields)
    hf.dtype = hf_config.get("dtype", "float32")
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(path)
    sd = random_state_dict(cfg, seed, device)
    if max_shard_tensors <= 0:
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    else:
        names = list(sd)
        chunks = [names[k : k + max_shard_tensors] for k in range(0, len(names), max_shard_tensors)]
        weight_map = {}
        for n, chunk in enumerate(chunks):
            fname = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
            save_file({k: sd[k] for k in chunk}, path / fname, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(chunk, fname))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def random_model(
    name: str, max_model_len: int, device: torch.device | str, seed: int = 0, tp: TPGroup | None = None
) -> LlamaModel:
    """A benchmark model of real shape (`1b` or `8b`), random bf16 weights made on the device; with
    `tp`, this rank's shard only."""
    cfg = parse_config(BENCH_CONFIGS[name])
    with torch.device(device):
        model = LlamaModel(cfg, max_model_len, tp=tp)
    g = torch.Generator(device=device).manual_seed(seed)
    for p in model.parameters():
        p.data.normal_(0.0, 0.02, generator=g)
    for norm in [model.norm] + [m for b in model.layers for m in (b.input_norm, b.post_attn_norm)]:
        norm.weight.data.fill_(1.0)
    return model.eval()


def write_random_adapter(
    path: Path, cfg: ModelConfig, rank: int, seed: int, alpha: float = 32.0, device: str = "cpu"
) -> Path:
    """A LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors) for a model
    of `cfg`, every linear layer targeted, random A and B (made on `device`): for benchmarks of
    real shapes, where building the HF model to let peft save one would take a minute."""
    import json

    g = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sizes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    weights = {}
    for n in range(cfg.num_layers):
        for name, (in_size, out_size) in sizes.items():
            key = f"base_model.model.model.layers.{n}.{name}"
            a = torch.randn(rank, in_size, generator=g, device=device) / in_size**0.5
            b = torch.randn(out_size, rank, generator=g, device=device) * 0.01
            weights[f"{key}.lora_A.weight"] = a.to(cfg.dtype).cpu()
            weights[f"{key}.lora_B.weight"] = b.to(cfg.dtype).cpu()
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, path / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": "all-linear",
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "use_rslora": False,
        "use_dora": False,
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
