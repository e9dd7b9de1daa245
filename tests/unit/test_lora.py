"""LoRA adapters made by the real `peft` library on tiny Llama- and Qwen2-shaped models: what we
read equals PEFT's weights, the slots add what PEFT's layers add (fused parts included, rsLoRA
scaling, smaller ranks zero-padded), a batch mixing adapters and rows without one equals each row
alone, and what we cannot serve is refused naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.lora_adapters import make_adapter
from tests.unit.conftest import make_hf_checkpoint
from workers.modeling.checkpoint import load_model, load_weights
from workers.modeling.config import load_config
from workers.modeling.lora import TARGETS, AdapterError, load_adapter

MAX_RANK = 8


def peft_layer(peft_model, layer: int, target: str):
    block = peft_model.base_model.model.model.layers[layer]
    return getattr(block.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, target)


def delta(model, layer: int, target: str, x: torch.Tensor, adapters: torch.Tensor) -> torch.Tensor:
    """What the model's slots add to one target's output (its slice of a fused layer) for inputs x."""
    owner, part = TARGETS[target]
    linear = model.layers[layer].get_submodule(owner)
    params = [p for p in (linear.weight, linear.bias) if p is not None]
    saved = [p.clone() for p in params]
    for p in params:  # views of the rows above the slots: with them zero the GEMM gives A x alone
        p.data.zero_()
    try:
        added = linear.adapter.forward(x, model.lora.batch(adapters), bias=True)
    finally:
        for p, kept in zip(params, saved, strict=True):
            p.data.copy_(kept)
    if owner in ("attn.o", "mlp.down"):
        return added
    start, stop = linear.part_ranges[part]
    return added[:, linear.part_offsets[part] : linear.part_offsets[part] + stop - start]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"lora-{request.param}") / "base"
    make_hf_checkpoint(path, request.param)
    return path


ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-rs": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all": dict(r=2, lora_alpha=16, target_modules="all-linear"),
}


def attn_adapter(base, path):
    """The "attn" adapter of the checkpoint at `base`, saved to path."""
    from transformers import AutoModelForCausalLM

    make_adapter(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), path, seed=1, **ADAPTERS["attn"])
    return path


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_the_slots_add_what_peft_adds(base, tmp_path, name):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = make_adapter(model, tmp_path / name, seed=3, **ADAPTERS[name])
    cfg = load_config(base)
    adapter = load_adapter(tmp_path / name, name, cfg, MAX_RANK)
    ours = load_model(base, max_model_len=64)
    ours.enable_lora(max_loras=2, max_rank=MAX_RANK).load(2, adapter)
    g = torch.Generator().manual_seed(5)
    for (layer, target), (a, b) in adapter.weights.items():
        module = peft_layer(peft_model, layer, target)
        assert torch.equal(a, module.lora_A["default"].weight) and torch.equal(b, module.lora_B["default"].weight)
        x = torch.randn(3, a.shape[1], generator=g)
        with torch.no_grad():
            want = module(x) - module.base_layer(x)
        got = delta(ours, layer, target, x, torch.tensor([2, 2, 0]))
        assert torch.allclose(got[:2], want[:2], rtol=1e-4, atol=1e-5) and not got[2].any()
        assert want.abs().max() > 1e-3  # the adapter matters
    assert len(adapter.weights) == cfg.num_layers * (7 if name == "all" else len(ADAPTERS[name]["target_modules"]))


def test_a_mixed_batch_equals_each_row_alone(base, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(base)
    ours = load_model(base, max_model_len=64)
    slots = ours.enable_lora(max_loras=3, max_rank=MAX_RANK)
    for slot, name in enumerate(ADAPTERS, 1):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        make_adapter(model, tmp_path / name, seed=slot, **ADAPTERS[name])
        slots.load(slot, load_adapter(tmp_path / name, name, cfg, MAX_RANK))
    rows = torch.tensor([0, 3, 1, 2, 0, 1, 3])
    g = torch.Generator().manual_seed(7)
    for target, size in (("q_proj", cfg.hidden_size), ("down_proj", cfg.intermediate_size)):
        x = torch.randn(len(rows), size, generator=g)
        batched = delta(ours, 1, target, x, rows)
        alone = torch.cat([delta(ours, 1, target, x[i : i + 1], rows[i : i + 1]) for i in range(len(rows))])
        assert torch.allclose(batched, alone, rtol=1e-5, atol=1e-6)
        assert not batched[rows == 0].any() and batched[rows == 3].abs().max() > 0


def test_loading_a_slot_again_replaces_the_adapter_in_place(base, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(base)
    ours = load_model(base, max_model_len=64)
    slots = ours.enable_lora(max_loras=1, max_rank=MAX_RANK)
    addresses = {k: (lin.a.data_ptr(), lin.b.data_ptr()) for k, lin in slots.linears.items()}
    for name in ("all", "attn"):
        make_adapter(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / name, seed=9, **ADAPTERS[name]
        )
        slots.load(1, load_adapter(tmp_path / name, name, cfg, MAX_RANK))
    assert {k: (lin.a.data_ptr(), lin.b.data_ptr()) for k, lin in slots.linears.items()} == addresses
    x = torch.randn(2, cfg.intermediate_size)
    assert not delta(ours, 0, "down_proj", x, torch.tensor([1, 1])).any()  # "attn" does not target it
    assert delta(ours, 0, "q_proj", x[:, : cfg.hidden_size], torch.tensor([1, 1])).abs().max() > 0


def test_weights_loaded_after_the_slots_reach_the_layers_gemm(base, tmp_path):
    """Slots move each adapted weight into a taller tensor; a later load (an in-place model swap)
    must still reach what both the plain and the LoRA forward multiply by."""
    other = tmp_path / "other"
    make_hf_checkpoint(other, json.loads((base / "config.json").read_text())["model_type"], seed=1)
    ours, fresh = load_model(base, max_model_len=64), load_model(other, max_model_len=64)
    ours.enable_lora(max_loras=2, max_rank=MAX_RANK)
    load_weights(ours, other)
    x = torch.randn(3, ours.cfg.hidden_size)
    none = ours.lora.batch(torch.zeros(3, dtype=torch.long))
    for mine, theirs in (
        (ours.layers[1].attn.qkv, fresh.layers[1].attn.qkv),
        (ours.layers[1].mlp.gate_up, fresh.layers[1].mlp.gate_up),
    ):
        want = theirs(x)
        assert torch.allclose(mine(x), want, rtol=1e-5, atol=1e-6)
        assert torch.allclose(mine(x, none), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 16}, "r"),
        ({"target_modules": ["embed_tokens"]}, "target_modules"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"lora_alpha": "x"}, "lora_alpha"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
        ({"use_qalora": True}, "use_qalora"),
        ({"target_parameters": ["mlp.experts.down_proj"]}, "target_parameters"),
        ({"init_lora_weights": "olora"}, "init_lora_weights"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights"),
        ({"init_lora_weights": "loftq"}, "init_lora_weights"),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(base, tmp_path, change, field):

    path = attn_adapter(base, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(AdapterError, match=field):
        load_adapter(path, "bad", load_config(base), MAX_RANK)


def test_an_adapter_whose_initialisation_rewrites_the_base_is_refused_and_others_are_not(base, tmp_path):
    """PiSSA (as peft saves it by default) is served by PEFT on base weights it rewrites as it
    loads: on the unchanged base it served other tokens, silently. Initialisations that leave the
    base alone load."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    get_peft_model(
        model, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"], init_lora_weights="pissa")
    ).save_pretrained(tmp_path / "pissa")
    with pytest.raises(AdapterError, match="init_lora_weights: 'pissa' rewrites the base"):
        load_adapter(tmp_path / "pissa", "pissa", load_config(base), MAX_RANK)
    path = attn_adapter(base, tmp_path / "plain")
    config = json.loads((path / "adapter_config.json").read_text())
    for init in (True, False, "gaussian", "orthogonal"):
        (path / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
        load_adapter(path, "plain", load_config(base), MAX_RANK)


def test_nulls_and_a_missing_alpha_read_as_peft_reads_them(base, tmp_path):
    """Configs written by other tools: null where PEFT takes its default, and no lora_alpha (PEFT's
    default is 8) were refused as a validation error."""
    path = attn_adapter(base, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    nulls = dict.fromkeys(("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "bias"))
    (path / "adapter_config.json").write_text(json.dumps({**config, **nulls}))
    assert load_adapter(path, "a", load_config(base), MAX_RANK).scaling == config["lora_alpha"] / config["r"]
    (path / "adapter_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "lora_alpha"}))
    assert load_adapter(path, "a", load_config(base), MAX_RANK).scaling == 8 / config["r"]


def test_added_tokens_and_missing_halves_are_refused(base, tmp_path):

    path = attn_adapter(base, tmp_path / "adapter")
    weights = load_file(path / "adapter_model.safetensors")
    extra = {**weights, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}
    save_file(extra, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="embed_tokens"):
        load_adapter(path, "bad", load_config(base), MAX_RANK)
    half = {k: v for k, v in weights.items() if not k.endswith("layers.0.self_attn.q_proj.lora_B.weight")}
    save_file(half, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="layer 0 q_proj"):
        load_adapter(path, "bad", load_config(base), MAX_RANK)


def test_a_bf16_adapter_file_is_scaled_in_fp32(base, tmp_path):
    """B of a file saved in bf16 (a hub adapter saved after .bfloat16()) was multiplied by its
    scaling (10/3 here) in bf16 before the copy into an fp32 slot: off by up to 0.4%, and 17 of 38
    greedy prompts decoded other tokens than PEFT. The slots now hold what the same values in fp32
    give."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "adapter"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    make_adapter(model, path, seed=2, r=3, lora_alpha=10, target_modules=["q_proj", "down_proj"])
    weights = load_file(path / "adapter_model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, path / "adapter_model.safetensors")
    in_bf16 = load_adapter(path, "bf16", load_config(base), MAX_RANK)
    save_file({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, path / "adapter_model.safetensors")
    in_fp32 = load_adapter(path, "fp32", load_config(base), MAX_RANK)
    slots = []
    for adapter in (in_bf16, in_fp32):
        ours = load_model(base, max_model_len=64)
        ours.enable_lora(max_loras=1, max_rank=MAX_RANK).load(1, adapter)
        slots.append([ours.layers[i].mlp.down.adapter.b.clone() for i in range(len(ours.layers))])
    assert all(torch.equal(a, b) for a, b in zip(*slots, strict=True))


def test_a_target_list_for_several_architectures_serves_the_modules_this_model_has(base, tmp_path):
    """Training tools write one list for many models (["q_proj", "v_proj", "c_attn", ...]); PEFT
    adapts what matches. An adapter that matches nothing, and a target regex that does not compile,
    are refused naming the field (the regex was a re.error: a 500 for the request)."""

    path = attn_adapter(base, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    for change, match in (
        ({"target_modules": [*config["target_modules"], "c_attn", "query_key_value"]}, None),
        ({"target_modules": ["c_attn", "query_key_value"]}, "select no linear layer"),
        ({"target_modules": "nothing"}, "select no linear layer"),
        ({"exclude_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, "select no linear layer"),
        ({"target_modules": "q_proj("}, "target_modules: 'q_proj\\(' is not a regular expression"),
        ({"exclude_modules": "(v_proj"}, "exclude_modules: .* is not a regular expression"),
    ):
        (path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        if match is None:
            loaded = load_adapter(path, "x", load_config(base), MAX_RANK)
            assert loaded.targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
            continue
        with pytest.raises(AdapterError, match=match):
            load_adapter(path, "x", load_config(base), MAX_RANK)


def test_bias_all_without_a_trained_bias_serves_and_a_trained_bias_is_refused(base, tmp_path):
    """bias="all" on layers without biases saves no bias (it computes what bias="none" computes) and
    was refused for its config field alone; a bias the file does hold is refused naming it."""
    path = attn_adapter(base, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    assert load_adapter(path, "x", load_config(base), MAX_RANK).targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
    weights = load_file(path / "adapter_model.safetensors")
    bias = {"base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(load_config(base).hidden_size)}
    save_file({**weights, **bias}, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"q_proj.bias: a trained bias \(bias='all'\) is not supported"):
        load_adapter(path, "x", load_config(base), MAX_RANK)


def test_a_pickled_adapter_is_refused_with_what_to_do(base, tmp_path):

    path = attn_adapter(base, tmp_path / "adapter")
    weights = load_file(path / "adapter_model.safetensors")
    torch.save(weights, path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="there is an adapter_model.bin: .*save it with safetensors"):
        load_adapter(path, "x", load_config(base), MAX_RANK)


def test_an_adapter_config_that_is_not_a_file_is_refused_without_reading_it(base, tmp_path):
    """A FIFO as adapter_config.json blocked the engine in open() until its watchdog killed it."""
    import os

    path = tmp_path / "adapter"
    path.mkdir()
    os.mkfifo(path / "adapter_config.json")
    with pytest.raises(AdapterError, match="adapter_config.json is not a file"):
        load_adapter(path, "x", load_config(base), MAX_RANK)


DECODE_STEPS = 32


@pytest.mark.parametrize("name", ["attn", "all", "mlp-rs"])
@torch.no_grad()
def test_our_model_with_an_adapter_decodes_what_peft_decodes(base, tmp_path, name):
    """Prefill logits and 32 greedy decode steps of our model with the adapter in a slot equal the
    PEFT model's (relative error <= 1e-4, the same tokens); the adapter changes the tokens."""
    from transformers import AutoModelForCausalLM

    from tests.kv_pages import assign_pages
    from tests.unit.test_model_reference import hf_forward, prefill_one, rel_err
    from workers.modeling.checkpoint import load_model

    peft_model = make_adapter(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / name, seed=11, **ADAPTERS[name]
    )
    ours = load_model(base, max_model_len=128)
    ours.enable_lora(max_loras=2, max_rank=MAX_RANK).load(2, load_adapter(tmp_path / name, name, ours.cfg, MAX_RANK))
    cache = ours.make_kv_cache(1)
    assign_pages(cache)
    prompt = torch.randint(0, ours.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    ref, past = hf_forward(peft_model.base_model.model, prompt)
    got = prefill_one(ours, prompt, cache, adapter=2)
    assert rel_err(got, ref) <= 1e-4
    tokens = []
    for step in range(DECODE_STEPS):
        assert got.argmax() == ref.argmax(), f"greedy token differs at step {step}"
        tok = ref.argmax()
        tokens.append(tok.item())
        ref, past = hf_forward(peft_model.base_model.model, tok.view(1), past)
        got = ours.decode(
            tok.view(1), torch.tensor([prompt.numel() + step]), torch.tensor([0]), cache, torch.tensor([2])
        )[0]
        assert rel_err(got, ref) <= 1e-4, f"decode logits differ at step {step}"
    with peft_model.disable_adapter():
        base_ref, _ = hf_forward(peft_model.base_model.model, prompt)
    assert not torch.allclose(base_ref, hf_forward(peft_model.base_model.model, prompt)[0], rtol=1e-3)
    assert len(set(tokens)) > 1


@torch.no_grad()
def test_a_prefill_mixing_three_adapters_and_none_equals_each_prompt_alone(base, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.kv_pages import assign_pages
    from tests.unit.test_model_reference import prefill_one
    from workers.modeling.checkpoint import load_model

    ours = load_model(base, max_model_len=128)
    slots = ours.enable_lora(max_loras=3, max_rank=MAX_RANK)
    for slot, name in enumerate(ADAPTERS, 1):
        make_adapter(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            tmp_path / name,
            seed=slot,
            **ADAPTERS[name],
        )
        slots.load(slot, load_adapter(tmp_path / name, name, ours.cfg, MAX_RANK))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, ours.cfg.vocab_size, (n,), generator=g) for n in (7, 3, 11, 5)]
    adapters = [2, 0, 3, 1]
    lens = [p.numel() for p in prompts]
    cache = ours.make_kv_cache(4)
    assign_pages(cache)
    rows = torch.cat([torch.full((n,), a) for n, a in zip(lens, adapters, strict=True)])
    slot_ids = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    positions = torch.cat([torch.arange(n) for n in lens])
    batched = ours.prefill(torch.cat(prompts), positions, slot_ids, lens, cache, rows)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        alone = ours.make_kv_cache(1)
        assign_pages(alone, seed=i + 1)
        assert torch.allclose(batched[i], prefill_one(ours, prompt, alone, adapter=adapter), rtol=1e-5, atol=1e-5), i


def test_exclude_modules_are_left_out_as_peft_leaves_them_out(base, tmp_path):
    """all-linear minus down_proj (a list) and minus layer 0's attention (a regex): the adapter adds
    nothing there, and what peft adds everywhere else."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(base)
    for exclude, left_out in (
        (["down_proj"], {(i, "down_proj") for i in range(cfg.num_layers)}),
        (r".*layers\.0\.self_attn\..*", {(0, t) for t in ("q_proj", "k_proj", "v_proj", "o_proj")}),
    ):
        path = tmp_path / str(len(left_out))
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = make_adapter(
            model, path, seed=4, r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=exclude
        )
        adapter = load_adapter(path, "x", cfg, MAX_RANK)
        assert set(adapter.weights) == {(i, t) for i in range(cfg.num_layers) for t in TARGETS} - left_out
        ours = load_model(base, max_model_len=64)
        ours.enable_lora(max_loras=1, max_rank=MAX_RANK).load(1, adapter)
        x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        for layer, target in left_out:
            if target != "down_proj":
                assert not delta(ours, layer, target, x, torch.tensor([1, 1])).any()
        module = peft_layer(peft_model, 1, "q_proj")
        with torch.no_grad():
            want = module(x) - module.base_layer(x)
        assert torch.allclose(delta(ours, 1, "q_proj", x, torch.tensor([1, 1])), want, rtol=1e-4, atol=1e-5)


def test_an_adapter_for_a_deeper_model_and_a_damaged_file_are_refused_by_name(base, tmp_path):
    """A tensor of a layer the base model does not have names that layer and the model's depth; a
    truncated adapter_model.safetensors is an AdapterError naming the file, not a library error."""

    path = attn_adapter(base, tmp_path / "adapter")
    cfg = load_config(base)
    weights = load_file(path / "adapter_model.safetensors")
    deeper = {
        k.replace("layers.0.", f"layers.{cfg.num_layers}."): v.clone() for k, v in weights.items() if "layers.0." in k
    }
    save_file({**weights, **deeper}, path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=f"layer {cfg.num_layers} is beyond the model's {cfg.num_layers} layers"):
        load_adapter(path, "deeper", cfg, MAX_RANK)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="adapter_model.safetensors: cannot be read"):
        load_adapter(path, "truncated", cfg, MAX_RANK)
