"""Checkpoint loading: what loads (sharded, bf16/fp16, dtype override) and how each unservable
directory is refused: always a CheckpointError whose message names the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.unit.conftest import write_tiny_checkpoint
from workers.modeling.checkpoint import load_model
from workers.modeling.checkpoint_dir import TOKENIZER_FILES, load_tokenizer
from workers.modeling.config import SUPPORTED_ARCHITECTURES, CheckpointError, load_config, parse_config
from workers.modeling.synthetic import tiny_hf_config

MAX_LEN = 64


def write_config(path, **overrides) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**tiny_hf_config(261), **overrides}))


def refused(model_dir) -> str:
    """Load `model_dir`, expect a CheckpointError, and return its message."""
    with pytest.raises(CheckpointError) as info:
        load_model(model_dir, max_model_len=MAX_LEN)
    return str(info.value)


@torch.no_grad()
def prefill_logits(model) -> torch.Tensor:
    tokens = torch.tensor([1, 50, 7, 200, 33, 9, 120])
    n = tokens.numel()
    return model.prefill(tokens, torch.arange(n), torch.zeros(n, dtype=torch.long), [n], model.make_kv_cache(1))


def test_missing_directory(tmp_path):
    """A path that does not exist is refused, naming the path."""
    msg = refused(tmp_path / "no-such-model")
    assert "no-such-model" in msg and "not a directory" in msg


def test_missing_config_json(tmp_path):
    """A directory without config.json is refused, naming config.json."""
    assert "missing config.json" in refused(tmp_path)


def test_invalid_config_json(tmp_path):
    """A config.json that is not JSON is refused as such (not a bare JSONDecodeError)."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    msg = refused(tmp_path)
    assert "config.json" in msg and "not valid JSON" in msg


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    """An architecture we cannot serve is named, together with every one we can."""
    write_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    msg = refused(tmp_path)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg


def test_unsupported_hidden_act(tmp_path):
    """hidden_act other than silu is refused, naming the activation found."""
    write_config(tmp_path, hidden_act="gelu")
    msg = refused(tmp_path)
    assert "hidden_act" in msg and "gelu" in msg and "silu" in msg


def test_unsupported_rope_type(tmp_path):
    """A RoPE scaling we do not implement (yarn) is refused rather than silently served wrong."""
    write_config(tmp_path, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    msg = refused(tmp_path)
    assert "rope" in msg and "yarn" in msg


def test_rope_v4_and_v5_spellings_parse_alike():
    """`rope_theta` + `rope_scaling` (transformers v4) and `rope_parameters` (v5) give one config."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    base = {k: v for k, v in tiny_hf_config(261).items() if k != "rope_parameters"}
    v4 = parse_config({**base, "rope_theta": 500000.0, "rope_scaling": scaling})
    v5 = parse_config({**base, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert v4 == v5
    assert v5.rope_theta == 500000.0 and v5.rope_type == "llama3" and v5.rope_scaling["factor"] == 8.0


def test_only_pytorch_bin_hints_to_convert(tmp_path):
    """A checkpoint with only pytorch_model.bin is refused, naming it and hinting at safetensors."""
    write_tiny_checkpoint(tmp_path)
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()
    msg = refused(tmp_path)
    assert "pytorch_model.bin" in msg and "convert" in msg and "safetensors" in msg


def test_missing_weight_is_named(tmp_path):
    """A tensor the model needs but the safetensors lacks is named in the error."""
    write_tiny_checkpoint(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.mlp.down_proj.weight" in refused(tmp_path)


def test_sharded_checkpoint_loads_like_unsharded(tmp_path):
    """The same weights written as several shards with an index load to identical parameters and
    bit-identical logits."""
    sharded = write_tiny_checkpoint(tmp_path / "sharded", seed=3, max_shard_tensors=5)
    single = write_tiny_checkpoint(tmp_path / "single", seed=3)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert not (sharded / "model.safetensors").exists()

    a = load_model(sharded, max_model_len=MAX_LEN)
    b = load_model(single, max_model_len=MAX_LEN)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert torch.equal(prefill_logits(a), prefill_logits(b))


def test_index_naming_missing_shard_is_refused(tmp_path):
    """An index that points at a shard file that is not there is refused, naming that file."""
    write_tiny_checkpoint(tmp_path, max_shard_tensors=5)
    gone = sorted(tmp_path.glob("model-*.safetensors"))[1]
    gone.unlink()
    msg = refused(tmp_path)
    assert gone.name in msg and "missing" in msg


HALF = [("bfloat16", torch.bfloat16), ("float16", torch.float16)]


@pytest.mark.parametrize("name, dtype", HALF, ids=["bf16", "fp16"])
def test_half_precision_checkpoints_load_in_their_dtype(tmp_path, name, dtype):
    """A bf16/fp16 checkpoint loads in that dtype with its exact values; dtype=float32 overrides
    the checkpoint's dtype (weights upcast exactly) and still runs."""
    write_tiny_checkpoint(tmp_path, dtype=name)
    stored = load_file(tmp_path / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == dtype

    model = load_model(tmp_path, max_model_len=MAX_LEN)
    assert model.cfg.dtype == dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.make_kv_cache(1).k.dtype == dtype
    assert torch.equal(model.embed.weight, stored["model.embed_tokens.weight"])
    logits = prefill_logits(model)  # fp32 whatever the weights' dtype, with more than their precision
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.to(dtype).float())

    wide = load_model(tmp_path, max_model_len=MAX_LEN, dtype=torch.float32)
    assert wide.cfg.dtype == torch.float32
    assert {p.dtype for p in wide.parameters()} == {torch.float32}
    assert torch.equal(wide.embed.weight, stored["model.embed_tokens.weight"].float())
    assert torch.equal(wide.lm_head.weight, stored["lm_head.weight"].float())
    logits = prefill_logits(wide)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_missing_tokenizer_names_files_looked_for(tmp_path):
    """load_tokenizer on a checkpoint without tokenizer files names each file it looked for."""
    write_tiny_checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(tmp_path)
    msg = str(info.value)
    assert "no tokenizer files" in msg
    for name in TOKENIZER_FILES:
        assert name in msg


def test_a_checkpoint_with_only_a_sentencepiece_model_is_served(tmp_path):
    """Older Llama 2 and Mistral fine-tunes ship `tokenizer.model` without `tokenizer.json`:
    transformers converts it with the `sentencepiece` library (without it the load failed asking
    for `tiktoken`). The model comes from sentencepiece's own trainer; its encoding is the reference,
    and an engine serves the checkpoint."""
    import sentencepiece

    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig
    from workers.serving.sampling import SamplingParams

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["The capital of France is Paris.", "Prices: 5€, café. 中文 😀", "def f(x): x"] * 50))
    model_dir = write_tiny_checkpoint(tmp_path / "ckpt", vocab_size=300)
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(model_dir / "tokenizer"),
        vocab_size=300,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    (model_dir / "tokenizer.vocab").unlink()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tokenizer = load_tokenizer(model_dir)
    text = "The capital of 中文 is 😀 Paris"
    reference = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == reference.encode(text) and tokenizer.decode(ids) == text
    engine, served = LLMEngine.from_config(
        EngineConfig(model=str(model_dir), max_model_len=MAX_LEN, max_num_seqs=1, device="cpu", dtype="float32")
    )
    assert served.encode(text, add_special_tokens=False) == ids
    seq = engine.add_request(ids, SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_work():
        engine.step()
    assert (len(seq.output_ids), seq.finish_reason) == (4, "length")


def test_malformed_index_is_refused_by_name(tmp_path):
    """A model.safetensors.index.json that is not JSON, or has no weight_map, is a CheckpointError
    naming the index, not a raw parsing error."""
    write_tiny_checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    for text in ("{not json", '{"metadata": {}}'):
        index.write_text(text)
        with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
            load_model(tmp_path, 64)


@pytest.mark.parametrize("eos", [[7, 9], 7])
def test_generation_config_eos_joins_the_configs(tmp_path, eos):
    """generation_config.json's eos_token_id (an id or a list) joins config.json's, each id once."""
    path = write_tiny_checkpoint(tmp_path / "m")
    own = load_config(path).eos_token_ids
    assert own and 7 not in own and 9 not in own
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.6}))
    joined = load_config(path).eos_token_ids
    assert joined == own + ((7, 9) if isinstance(eos, list) else (7,))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(own), "do_sample": True}))
    assert load_config(path).eos_token_ids == own


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"eos_token_id": [7,', "not valid JSON"),
        ("[7, 9]", "not a JSON object"),
        ('{"eos_token_id": "</s>"}', "eos_token_id must be a token id"),
    ],
)
def test_malformed_generation_config_is_refused_by_name(tmp_path, text, reason):
    """A generation_config.json the EOS ids cannot be read from is refused, naming the file."""
    path = write_tiny_checkpoint(tmp_path / "m")
    (path / "generation_config.json").write_text(text)
    msg = refused(path)
    assert "generation_config.json" in msg and reason in msg


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("lm_head.weight", (320, 64)),  # vocab rows beyond config.json's vocab_size
        ("model.layers.0.self_attn.q_proj.weight", (32, 64)),
        ("model.layers.1.mlp.gate_proj.weight", (256, 64)),
        ("model.layers.0.mlp.down_proj.weight", (64, 256)),
    ],
)
def test_a_tensor_of_another_shape_than_the_config_implies_is_refused_by_name(tmp_path, name, shape):
    """A tensor whose shape config.json does not imply is refused naming it and both shapes, not
    sliced or zero-padded into the model (transformers refuses these too)."""
    write_tiny_checkpoint(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert tuple(weights[name].shape) != shape
    weights[name] = torch.randn(shape)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    msg = refused(tmp_path)
    assert name in msg and str(list(shape)) in msg and "config.json implies" in msg


def test_a_config_without_its_head_dim_is_refused_by_the_shapes(tmp_path):
    """A config.json that lost its explicit head_dim implies other q/k/v shapes: refused, not run."""
    write_tiny_checkpoint(tmp_path, head_dim=32)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert "q_proj.weight" in refused(tmp_path)


def test_a_failed_load_leaves_the_weights_it_had(tmp_path):
    """Every tensor is checked before any is copied: loading a damaged checkpoint into a model (a
    model swap in place) fails without changing its weights."""
    from workers.modeling.checkpoint import load_weights

    good = write_tiny_checkpoint(tmp_path / "good", seed=1)
    bad = write_tiny_checkpoint(tmp_path / "bad", seed=2)
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] = torch.randn(3, 3)
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    model = load_model(good, max_model_len=MAX_LEN)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="down_proj"):
        load_weights(model, bad)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_quantized_checkpoints_are_refused(tmp_path):
    """An FP8 export (quantization_config, float8 weights and their scales) is refused naming the
    quantization, not cast to float with its scales dropped; float8 tensors without the config too."""
    configured = write_tiny_checkpoint(tmp_path / "configured")
    raw = json.loads((configured / "config.json").read_text())
    (configured / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "fp8"}}))
    msg = refused(configured)
    assert "quantization_config" in msg and "fp8" in msg
    write_tiny_checkpoint(tmp_path / "fp8")
    weights = load_file(tmp_path / "fp8" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    msg = refused(tmp_path / "fp8")
    assert name in msg and "F8_E4M3" in msg and "quantized" in msg


def test_damaged_weight_and_tokenizer_files_are_refused_by_name(tmp_path):
    """A truncated safetensors file, an index mapping a tensor to a shard without it, and a
    corrupt tokenizer.json are CheckpointErrors naming the file, not bare library errors."""
    truncated = write_tiny_checkpoint(tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = refused(truncated)
    assert "model.safetensors" in msg and "truncated or damaged" in msg

    sharded = write_tiny_checkpoint(tmp_path / "sharded", max_shard_tensors=5)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["lm_head.weight"])
    index["weight_map"]["lm_head.weight"] = wrong
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = refused(sharded)
    assert "lm_head.weight" in msg and wrong in msg

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model":')
    with pytest.raises(CheckpointError, match="tokenizer cannot be loaded"):
        load_tokenizer(tmp_path / "tok")


def test_config_defaults_follow_transformers():
    """Keys a config.json may leave out take transformers' defaults: rms_norm_eps 1e-6, a Mistral
    window of 4096 (an explicit null: none), and hidden_act 'swish' is silu."""
    base = {k: v for k, v in tiny_hf_config(261).items() if k != "rms_norm_eps"}
    assert parse_config(base).rms_norm_eps == 1e-6
    mistral = {**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert parse_config(mistral).sliding_window == 4096
    assert parse_config({**mistral, "sliding_window": None}).sliding_window is None
    assert parse_config({**base, "hidden_act": "swish"}) == parse_config(base)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 4), (4, 0), (4, "2"), (0, 1)])
def test_heads_that_do_not_group_are_refused_naming_the_keys(heads, kv_heads):
    """6 attention heads over 4 key/value heads: transformers saves such a config (and fails in its
    forward); it failed here in the warm-up with a reshape error that named neither key."""
    raw = {**tiny_hf_config(261), "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    with pytest.raises(CheckpointError, match=rf"num_attention_heads={heads!r} and num_key_value_heads="):
        parse_config(raw)


def test_rope_scaling_added_to_a_v5_config_is_read_as_transformers_reads_it():
    """A context-extension edit adds rope_scaling to a config that transformers v5 saved with
    rope_parameters {"rope_type": "default"}: transformers applies rope_scaling, and graphserve read
    the default rope and decoded other tokens from the first one on."""
    from transformers import LlamaConfig

    raw = {
        **tiny_hf_config(261),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    theirs = LlamaConfig.from_dict(raw).rope_parameters
    ours = parse_config(raw)
    assert (ours.rope_type, ours.rope_scaling["factor"]) == (theirs["rope_type"], theirs["factor"]) == ("linear", 4.0)
    assert ours.rope_theta == theirs["rope_theta"]


@torch.no_grad()
def test_a_stored_head_other_than_the_embedding_is_kept_apart_as_transformers_does(tmp_path):
    """A fine-tune that untied the head stores lm_head.weight while config.json still ties it:
    graphserve ignored the tensor (a log line) and used the embedding, and every token differed.
    Logits now equal transformers' on the same files; a stored head equal to the embedding stays
    tied (one copy)."""
    from transformers import AutoModelForCausalLM

    from tests.unit.conftest import make_hf_checkpoint

    make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    weights = load_file(tmp_path / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embedding.clone()}, tmp_path / "model.safetensors")
    assert load_config(tmp_path).tie_word_embeddings
    save_file({**weights, "lm_head.weight": torch.randn_like(embedding)}, tmp_path / "model.safetensors")
    assert not load_config(tmp_path).tie_word_embeddings
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    ours = load_model(tmp_path, max_model_len=64)
    hidden = torch.randn(3, embedding.shape[1])
    assert torch.allclose(ours.logits(hidden), theirs.lm_head(theirs.model.norm(hidden)), rtol=1e-5, atol=1e-5)
