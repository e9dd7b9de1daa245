"""LoRA adapters in PEFT format, and the fixed slots that hold them on the device.

An adapter (`adapter_config.json` + `adapter_model.safetensors`, as PEFT saves it) adds
B @ A x * scaling to each linear layer it targets; scaling is lora_alpha / r, or lora_alpha / sqrt(r)
with rsLoRA. Our QKV and gate/up layers are fused: each of q, k, v (gate, up) is one part of its
layer's output, and its adapter applies to that slice only. What PEFT can do that is not supported
here is refused with the field that asks for it.

Slots are allocated once per targeted layer: A [slots, max_rank, in], B [slots, out, max_rank], slot
0 the null adapter (zeros: adds nothing); B is stored with its scaling folded in and smaller ranks
zero-padded, so loading an adapter is a copy into a free slot, and the slots keep their addresses
(captured graphs read them). A batch's rows each name a slot; `delta` is one gather and two batched
matmuls per layer part for all rows.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import safe_open

from workers.modeling.config import ModelConfig

# PEFT's module names -> (our module within a block, part of a fused layer)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn.qkv", 0), "k_proj": ("attn.qkv", 1), "v_proj": ("attn.qkv", 2), "o_proj": ("attn.o", 0),
    "gate_proj": ("mlp.gate_up", 0), "up_proj": ("mlp.gate_up", 1), "down_proj": ("mlp.down", 0),
}  # fmt: skip
PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the field or tensor."""


class AdapterConfig(BaseModel):
    """The fields of PEFT's adapter_config.json that change what an adapter computes. Others
    (task_type, base_model_name_or_path, inference_mode, lora_dropout, ...) do not and are ignored."""

    model_config = ConfigDict(extra="ignore")

    peft_type: str = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float
    target_modules: list[str] | str
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool = False
    rank_pattern: dict = {}
    alpha_pattern: dict = {}
    layers_to_transform: list[int] | int | None = None

    @field_validator("peft_type")
    @classmethod
    def _lora(cls, v: str) -> str:
        if v != "LORA":
            raise ValueError(f"only LORA adapters are supported, not {v}")
        return v

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def refusal(config: AdapterConfig, max_rank: int) -> str | None:
    """Why this adapter cannot be served, naming the field; None when it can."""
    unsupported = {
        "use_dora": config.use_dora, "bias": config.bias != "none", "modules_to_save": bool(config.modules_to_save),
        "fan_in_fan_out": config.fan_in_fan_out, "rank_pattern": bool(config.rank_pattern),
        "alpha_pattern": bool(config.alpha_pattern), "layers_to_transform": config.layers_to_transform is not None,
    }  # fmt: skip
    for field, used in unsupported.items():
        if used:
            return f"{field}: not supported ({getattr(config, field)!r})"
    if config.r > max_rank:
        return f"r: rank {config.r} is above max_lora_rank {max_rank}"
    return None


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT target) -> (A, B)

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}


def targeted(config: AdapterConfig, num_layers: int) -> set[tuple[int, str]]:
    """The (layer, target) pairs the config's target_modules select, by PEFT's rules: a string is a
    regex matched against the whole module name; a list names modules by their last parts."""
    names = {(i, t): f"model.layers.{i}.{PARENTS[t]}.{t}" for i in range(num_layers) for t in TARGETS}
    if config.target_modules == "all-linear":
        return set(names)
    if isinstance(config.target_modules, str):
        return {key for key, name in names.items() if re.fullmatch(config.target_modules, name)}
    wanted = set(config.target_modules)
    unknown = sorted(w for w in wanted if not any(n == w or n.endswith("." + w) for n in names.values()))
    if unknown:
        raise AdapterError(f"target_modules: {unknown} are not linear layers of this model "
                           f"(supported: {', '.join(TARGETS)})")  # fmt: skip
    return {key for key, name in names.items() if any(name == w or name.endswith("." + w) for w in wanted)}


def load_adapter(path: str | Path, name: str, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT adapter for a model of `cfg`; AdapterError names what is wrong."""
    path = Path(path)
    try:
        config = AdapterConfig.model_validate(json.loads((path / "adapter_config.json").read_text()))
    except OSError as e:
        raise AdapterError(f"{path}: no adapter_config.json ({e.strerror or e})") from e
    except ValidationError as e:
        err = e.errors()[0]
        raise AdapterError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from e
    except ValueError as e:
        raise AdapterError(f"{path / 'adapter_config.json'}: not valid JSON ({e})") from e
    why = refusal(config, max_rank)
    if why:
        raise AdapterError(why)
    wanted = targeted(config, cfg.num_layers)
    sizes = _sizes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{path}: no adapter_model.safetensors")
    with safe_open(weights_file, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            m = TENSOR_NAME.match(key)
            if m is None or m.group(3) not in TARGETS or PARENTS[m.group(3)] != m.group(2):
                raise AdapterError(f"tensor {key}: not a LoRA A/B weight of a linear layer (added tokens, "
                                   "embeddings and extra modules are not supported)")  # fmt: skip
            layer, target = int(m.group(1)), m.group(3)
            if (layer, target) not in wanted:
                raise AdapterError(f"tensor {key}: its layer is not in target_modules")
            found.setdefault((layer, target), {})[m.group(4)] = f.get_tensor(key)
    weights = {}
    for key in sorted(wanted):
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {key[0]} {key[1]}: lora_A and lora_B weights are both needed")
        a, b = pair["A"], pair["B"]
        in_size, out_size = sizes[key[1]]
        if tuple(a.shape) != (config.r, in_size) or tuple(b.shape) != (out_size, config.r):
            raise AdapterError(f"layer {key[0]} {key[1]}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                               f"fit r={config.r} and the layer's {in_size} -> {out_size}")  # fmt: skip
        weights[key] = (a, b)
    return LoraAdapter(name, config.r, config.scaling, weights)


def _sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target, unsharded."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip


class LoraSlots:
    """Device tensors holding up to max_loras adapters (slot 0: none), allocated once."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:  # fmt: skip
        self.max_loras, self.max_rank = max_loras, max_rank
        slots = max_loras + 1
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for target, (in_size, out_size) in _sizes(cfg).items():
                self.a[(layer, target)] = torch.zeros(slots, max_rank, in_size, dtype=dtype, device=device)
                self.b[(layer, target)] = torch.zeros(slots, out_size, max_rank, dtype=dtype, device=device)

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot (1..max_loras), in place; what it does not target stays zero."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot {slot} is not one of 1..{self.max_loras}")
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        for key, (a, b) in adapter.weights.items():
            self.a[key][slot, : adapter.rank].copy_(a)
            self.b[key][slot, :, : adapter.rank].copy_(b * adapter.scaling)

    def delta(self, layer: int, target: str, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """What each row's adapter adds to a target's output: x (rows, in), slots (rows,) -> (rows, out)."""
        shrunk = torch.bmm(self.a[(layer, target)][slots], x.unsqueeze(-1))  # (rows, max_rank, 1)
        return torch.bmm(self.b[(layer, target)][slots], shrunk).squeeze(-1)
