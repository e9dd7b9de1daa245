"""Tiny GGUF files written as llama.cpp's converter lays them out (gguf-py's writer, `blk.N.*` tensor
names, Q/K rows permuted for llama.cpp's rope, F32 norms, a byte-level BPE tokenizer in the
metadata), from a random transformers Llama: what a user's `.gguf` made by other tools looks like."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from workers.modeling.synthetic import tiny_hf_config

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. 12345 " * 20
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def bpe_tokenizer() -> dict:
    """A byte-level BPE trained on TEXT, with Llama 3's specials last: tokens, types, merges, ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    spec = json.loads(tok.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get) + SPECIALS
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    n = len(tokens)
    return {
        "tokens": tokens,
        "types": [1] * (n - 3) + [3] * 3,
        "merges": merges,
        "bos": n - 3,
        "eos": n - 2,
        "eot": n - 1,
    }


def tiny_llama(vocab: int, seed: int = 0, tied: bool = False, intermediate_size: int = 192):
    """The tiny model's shape (`tiny_hf_config`) as a random transformers Llama whose logits are far
    from flat."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = {**tiny_hf_config(vocab), "intermediate_size": intermediate_size, "tie_word_embeddings": tied}
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    return model.eval()


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a q or k projection (its rope pairs adjacent dimensions)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model,
    tokenizer: dict,
    *,
    drop: tuple[str, ...] = (),
    split_max_tensors: int = 0,
    rope_scaling: tuple[str, float] | None = None,
    rope_freqs: np.ndarray | None = None,
    eot: bool = True,
    matrices: type = np.float32,
) -> Path:
    """`model` as llama.cpp would write it (F32 tensors, or its matrices in `matrices`: np.float16
    for an F16 file, whose norms stay F32), less the tensors named in `drop`; in shards
    of `split_max_tensors` as gguf-split writes them; with rope scaling metadata (type, factor) and
    a `rope_freqs` tensor (Llama 3.1's scaling, as llama.cpp stores it) when given."""
    cfg = model.config
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(0 if matrices == np.float32 else 1)
    if rope_scaling:
        w.add_string(gguf.Keys.Rope.SCALING_TYPE.format(arch="llama"), rope_scaling[0])
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    w.add_token_merges(tokenizer["merges"])
    w.add_bos_token_id(tokenizer["bos"])
    w.add_eos_token_id(tokenizer["eos"])
    if eot:
        w.add_eot_token_id(tokenizer["eot"])
    w.add_add_bos_token(True)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": _permuted(sd[p + "self_attn.q_proj.weight"], heads),
            f"blk.{i}.attn_k.weight": _permuted(sd[p + "self_attn.k_proj.weight"], kv_heads),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        }
    tensors["output_norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = sd["lm_head.weight"]
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs.astype(np.float32)
    for name, array in tensors.items():
        if name not in drop:
            w.add_tensor(name, np.ascontiguousarray(array, dtype=matrices if array.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
