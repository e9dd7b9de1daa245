"""LoRA adapters in PEFT format, and the fixed slots that hold them on the device.

An adapter (`adapter_config.json` + `adapter_model.safetensors`, as PEFT saves it) adds
B @ A x * scaling to each linear layer it targets; scaling is lora_alpha / r, or lora_alpha / sqrt(r)
with rsLoRA. Our QKV and gate/up layers are fused: each of q, k, v (gate, up) is one part of its
layer's output, and its adapter applies to that slice only. What PEFT can do that is not supported
here is refused with the field that asks for it.

Slots are allocated once per adapted linear layer, for the targets the server allows
(`lora.target_modules`): max_loras slots of max_rank, smaller ranks zero-padded, B with its scaling
folded in. Slot 0 is the null adapter: no storage, a row naming it gets nothing added. Loading an
adapter is a copy into a slot; the slots keep their addresses, so captured graphs read whatever a
slot holds. A layer's slots of A sit under its weight, so the layer's own GEMM computes every
slot's A x; a call's rows each name a slot, and each adapted layer then adds all rows' B s in one
kernel on the GPU, each row reading only its own slot of B (`lora_kernels.py`), or on the CPU and
for long prefills with a mask and an addmm per part (`LinearLora`). Either way a LoRA step costs
more than a plain one (A's rows in every GEMM, the expand launches), which is why batches without
adapters run graphs captured without LoRA (`graph_runner.py`), whose GEMMs read the weight alone.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from safetensors import SafetensorError, safe_open

from workers.modeling import lora_kernels
from workers.modeling.config import ModelConfig
from workers.modeling.parallel import RowParallelLinear

if TYPE_CHECKING:
    from torch import nn

    from workers.modeling.parallel import ColumnParallelLinear

# PEFT's module names -> (our module within a block, part of a fused layer)
TARGETS: dict[str, tuple[str, int]] = {  # in LORA_TARGETS' order
    "q_proj": ("attn.qkv", 0),
    "k_proj": ("attn.qkv", 1),
    "v_proj": ("attn.qkv", 2),
    "o_proj": ("attn.o", 0),
    "gate_proj": ("mlp.gate_up", 0),
    "up_proj": ("mlp.gate_up", 1),
    "down_proj": ("mlp.down", 0),
}
PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message names the field or tensor."""


# PEFT's LoRA variants, each asked for by one adapter_config.json field, that compute otherwise than
# B @ A x * scaling on every token: refused by name when set
VARIANT_FIELDS = (
    "alora_invocation_tokens",
    "use_qalora",
    "layer_replication",
    "lora_bias",
    "target_parameters",
    "trainable_token_indices",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)


# init_lora_weights values with which PEFT rewrites the base weights as it loads the adapter (the
# residual W - BA of the weights' own decomposition): served on the unchanged base they are wrong.
# Converted (save_pretrained's path_initial_model_for_weight_conversion) they are plain adapters.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterConfig(BaseModel):
    """The fields of PEFT's adapter_config.json that change what an adapter computes. Others
    (task_type, base_model_name_or_path, inference_mode, lora_dropout, ...) do not; they are kept
    apart (`model_extra`) and only the `VARIANT_FIELDS` and `init_lora_weights` among them are
    looked at."""

    model_config = ConfigDict(extra="allow")

    peft_type: str = "LORA"
    r: int = Field(ge=1)
    lora_alpha: float = 8  # PEFT's default
    target_modules: list[str] | str
    exclude_modules: list[str] | str | None = None
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool = False
    rank_pattern: dict = {}
    alpha_pattern: dict = {}
    layers_to_transform: list[int] | int | None = None

    @field_validator("use_rslora", "use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "bias", mode="before")
    @classmethod
    def _null_is_the_default(cls, v: Any, info: ValidationInfo) -> Any:
        """null where PEFT reads its default (configs written by other tools)."""
        return cls.model_fields[info.field_name].get_default(call_default_factory=True) if v is None else v

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
        "use_dora": config.use_dora,
        "modules_to_save": bool(config.modules_to_save),
        "fan_in_fan_out": config.fan_in_fan_out,
        "rank_pattern": bool(config.rank_pattern),
        "alpha_pattern": bool(config.alpha_pattern),
        "layers_to_transform": config.layers_to_transform is not None,
    }
    for field, used in unsupported.items():
        if used:
            return f"{field}: not supported ({getattr(config, field)!r})"
    extra = config.model_extra or {}
    for field in VARIANT_FIELDS:
        if extra.get(field):
            return f"{field}: this LoRA variant is not supported ({extra[field]!r})"
    init = extra.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        return (
            f"init_lora_weights: {init!r} rewrites the base model's weights as PEFT loads the adapter; "
            "save it converted to a plain LoRA (save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)) to serve it on the base model"
        )
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
    """The (layer, target) pairs the config's target_modules select and its exclude_modules do not,
    by PEFT's rules: a string is a regex matched against the whole module name; a list names
    modules by their last parts, and names no module of this model has are passed over (training
    tools write one list for several architectures: ["q_proj", "v_proj", "c_attn", ...]). An
    adapter that selects nothing is refused, as PEFT refuses it; one that targets other modules
    (lm_head, embeddings) is refused by its tensors' names."""
    every = {(i, t): f"model.layers.{i}.{PARENTS[t]}.{t}" for i in range(num_layers) for t in TARGETS}
    names = {k: n for k, n in every.items() if not (config.exclude_modules and _named("exclude_modules", config, n))}
    if config.target_modules == "all-linear":
        chosen = set(names)
    else:
        chosen = {key for key, name in names.items() if _named("target_modules", config, name)}
    if not chosen:
        raise AdapterError(
            f"target_modules {config.target_modules!r} (exclude_modules {config.exclude_modules!r}) select no "
            f"linear layer of this model (its layers: {', '.join(TARGETS)})"
        )
    return chosen


def _named(field: str, config: AdapterConfig, name: str) -> bool:
    """Whether PEFT's modules in the config's `field` (a regex over the whole name, or a list of
    last parts) name the module `name`."""
    modules = getattr(config, field)
    if isinstance(modules, str):
        try:
            return re.fullmatch(modules, name) is not None
        except re.error as e:
            raise AdapterError(f"{field}: {modules!r} is not a regular expression ({e})") from None
    return any(name == m or name.endswith("." + m) for m in modules)


def adapter_version(path: str | Path) -> tuple:
    """What tells two versions of the files at an adapter's path apart without reading them: each
    file's size, modification time and inode (a retrained adapter saved over the old one, or a
    directory replaced by another, changes one of them)."""
    out = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = (Path(path) / name).stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


def read_adapter_config(path: Path) -> AdapterConfig:
    """The adapter's adapter_config.json; AdapterError names what is wrong with it."""
    if (path / "adapter_config.json").exists() and not (path / "adapter_config.json").is_file():
        raise AdapterError(f"{path}: adapter_config.json is not a file")  # a FIFO would block the read
    try:
        return AdapterConfig.model_validate(json.loads((path / "adapter_config.json").read_text()))
    except OSError as e:
        raise AdapterError(f"{path}: no adapter_config.json ({e.strerror or e})") from e
    except ValidationError as e:
        err = e.errors()[0]
        raise AdapterError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}") from e
    except ValueError as e:
        raise AdapterError(f"{path / 'adapter_config.json'}: not valid JSON ({e})") from e


def screen_adapter(path: str | Path, num_layers: int, max_rank: int, slot_targets: Collection[str]) -> str | None:
    """Why the adapter at `path` cannot go into slots of `max_rank` on `slot_targets`, from its
    adapter_config.json alone (its tensors are checked as it loads): cheap enough to run over every
    served adapter as a replica starts. None: nothing in its config refuses it."""
    try:
        config = read_adapter_config(Path(path))
        why = refusal(config, max_rank)
        targets = set() if why else {target for _, target in targeted(config, num_layers)}
    except AdapterError as e:
        return str(e)
    return why or slot_refusal(targets, config.r, slot_targets, max_rank)


def slot_refusal(targets: Collection[str], rank: int, slot_targets: Collection[str], max_rank: int) -> str | None:
    """Why an adapter on `targets` of `rank` needs more than slots on `slot_targets` of
    `max_rank` give (raising the limits means new slots, so new graphs: a rebuild)."""
    outside = sorted(set(targets) - set(slot_targets))
    if outside:
        return f"target_modules: {outside} are outside lora.target_modules {list(slot_targets)}"
    if rank > max_rank:
        return f"r: rank {rank} is above max_lora_rank {max_rank}"
    return None


def load_adapter(
    path: str | Path, name: str, cfg: ModelConfig, max_rank: int, device: torch.device | str = "cpu"
) -> LoraAdapter:
    """Read and check a PEFT adapter for a model of `cfg`, its tensors onto `device` (so the copy
    into a slot is one on the device); AdapterError names what is wrong."""
    path = Path(path)
    config = read_adapter_config(path)
    why = refusal(config, max_rank)
    if why:
        raise AdapterError(why)
    wanted = targeted(config, cfg.num_layers)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        pickled = " (there is an adapter_model.bin: a pickle, never read here; save it with safetensors)"
        raise AdapterError(
            f"{path}: no adapter_model.safetensors" + (pickled if (path / "adapter_model.bin").is_file() else "")
        )
    try:
        with safe_open(weights_file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                m = TENSOR_NAME.match(key)
                if key.endswith(".bias"):
                    raise AdapterError(f"tensor {key}: a trained bias (bias={config.bias!r}) is not supported")
                if m is None or m.group(3) not in TARGETS or PARENTS[m.group(3)] != m.group(2):
                    raise AdapterError(
                        f"tensor {key}: not a LoRA A/B weight of a linear layer (added tokens, "
                        "embeddings and extra modules are not supported)"
                    )
                layer, target = int(m.group(1)), m.group(3)
                if layer >= cfg.num_layers:
                    raise AdapterError(
                        f"tensor {key}: layer {layer} is beyond the model's {cfg.num_layers} layers "
                        "(an adapter for another base model?)"
                    )
                if (layer, target) not in wanted:
                    raise AdapterError(f"tensor {key}: its layer is not in target_modules or is in exclude_modules")
                found.setdefault((layer, target), {})[m.group(4)] = f.get_tensor(key).to(device)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{weights_file}: cannot be read ({e}); a truncated or damaged file?") from e
    weights = {}
    for key in sorted(wanted):
        pair = found.get(key, {})
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {key[0]} {key[1]}: lora_A and lora_B weights are both needed")
        a, b = pair["A"], pair["B"]
        out_size, in_size = cfg.tensor_shape(key[1])
        if tuple(a.shape) != (config.r, in_size) or tuple(b.shape) != (out_size, config.r):
            raise AdapterError(
                f"layer {key[0]} {key[1]}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"fit r={config.r} and the layer's {in_size} -> {out_size}"
            )
        weights[key] = (a, b)
    finite = [torch.isfinite(a).all() & torch.isfinite(b.float() * config.scaling).all() for a, b in weights.values()]
    for key, ok in zip(weights, torch.stack(finite).tolist() if finite else [], strict=True):  # one sync
        if not ok:
            raise AdapterError(f"layer {key[0]} {key[1]}: lora_A or lora_B (times the scaling) holds NaN or inf")
    return LoraAdapter(name, config.r, config.scaling, weights)


class LoraBatch:
    """A model call's per-row adapter slots: as they are, for the kernels (`lora_kernels.py`), and as
    the masks the matmul form multiplies by: a layer with P adapted parts has P * max_loras *
    max_rank slot columns, and a row keeps only its own slot's."""

    def __init__(self, adapters: torch.Tensor, column_slot: torch.Tensor, dtype: torch.dtype) -> None:
        self.adapters = adapters
        self.rows = adapters.shape[0]
        self.kernels = adapters.is_cuda and lora_kernels.available() and self.rows <= lora_kernels.MAX_ROWS
        self._column_slot, self._dtype = column_slot, dtype
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, parts: int) -> torch.Tensor:
        if 1 not in self._masks:
            self._masks[1] = (self.adapters[:, None] == self._column_slot[None, :]).to(self._dtype)
        if parts not in self._masks:
            self._masks[parts] = self._masks[1].repeat(1, parts)
        return self._masks[parts]


class LinearLora:
    """The adapter slots of one linear layer, fused parts and tensor-parallel shard included.

    A [parts * max_loras * max_rank, in] stacks every part's slots, as extra rows under the layer's
    weight (one tensor, the layer's weight and bias views of its first rows), so one GEMM gives the
    layer's output and every slot's A x. B [out, max_loras, max_rank] holds each output feature's
    slots, and a feature takes the delta of its own part (`row_part`). Sharded as the layer is: a
    column-parallel layer keeps its rows of B (A whole), a row-parallel layer its columns of A (B
    whole, its partial delta summed by the layer's own all-reduce). A call of few rows on the GPU
    adds B s in one kernel (`lora_kernels.py`); otherwise (CPU, long prefills) s is masked to each
    row's slot and added with one addmm per part."""

    def __init__(
        self,
        layer: ColumnParallelLinear | RowParallelLinear,
        parts: list[tuple[str, int]],
        max_loras: int,
        max_rank: int,
    ) -> None:
        out_local, in_local = layer.weight.shape
        self.targets = [target for target, _ in parts]
        self.max_loras, self.max_rank, self.out_features = max_loras, max_rank, out_local
        slot_rows = len(parts) * max_loras * max_rank
        self.weight = self._stacked(layer.weight, slot_rows)
        self.bias = None if layer.bias is None else self._stacked(layer.bias, slot_rows)
        self.a = self.weight[out_local:]
        self.b = self.weight.new_zeros(out_local, max_loras, max_rank)
        self.row_part = torch.full((out_local,), -1, dtype=torch.int32, device=self.weight.device)
        # per target: the adapter's input columns this shard reads, its output rows this shard
        # holds, and where those rows sit in the (fused) layer's local output
        self.shard: dict[str, tuple[slice, slice, int]] = {}
        self.part_rows: list[slice] = []
        for index, (target, part) in enumerate(parts):
            if isinstance(layer, RowParallelLinear):
                self.shard[target] = (slice(*layer.in_range), slice(None), 0)
                rows = slice(0, out_local)
            else:
                start, stop = layer.part_ranges[part]
                self.shard[target] = (slice(None), slice(start, stop), layer.part_offsets[part])
                rows = slice(layer.part_offsets[part], layer.part_offsets[part] + stop - start)
            self.part_rows.append(rows)
            self.row_part[rows] = index

    @staticmethod
    def _stacked(param: torch.Tensor, extra_rows: int) -> torch.Tensor:
        """`param` with `extra_rows` zero rows under it, in one new tensor; the parameter becomes a
        view of its first rows, so loading weights (a copy into the parameter) still reaches it."""
        stacked = param.new_zeros(param.shape[0] + extra_rows, *param.shape[1:])
        stacked[: param.shape[0]].copy_(param)
        param.data = stacked[: param.shape[0]]
        return stacked

    def columns(self, index: int, slot: int, rank: int) -> slice:
        start = (index * self.max_loras + slot - 1) * self.max_rank
        return slice(start, start + rank)

    def load(self, slot: int, adapter: LoraAdapter, layer: int) -> None:
        self.b[:, slot - 1].zero_()
        for index, target in enumerate(self.targets):
            self.a[self.columns(index, slot, self.max_rank)].zero_()
            if (layer, target) not in adapter.weights:
                continue
            a, b = adapter.weights[(layer, target)]
            in_cols, out_rows, offset = self.shard[target]
            b = b[out_rows]
            self.a[self.columns(index, slot, adapter.rank)].copy_(a[:, in_cols])
            # scaled in fp32: a file's bf16 B times a scaling like 10/3, rounded to bf16, was off
            # by up to 0.4% in an fp32 slot (and fp16 overflowed)
            self.b[offset : offset + b.shape[0], slot - 1, : adapter.rank].copy_(b.float() * adapter.scaling)

    def forward(self, x: torch.Tensor, batch: LoraBatch, bias: bool) -> torch.Tensor:
        """The layer's output for x (2-D: rows, features) plus each row's adapter delta; `bias`:
        whether this shard adds the layer's bias."""
        z = F.linear(x, self.weight, self.bias if bias else None)
        y, s = z[:, : self.out_features], z[:, self.out_features :]
        if batch.kernels:
            return lora_kernels.lora_expand(y, s, self.b, self.row_part, batch.adapters)
        y, s = y.contiguous(), s * batch.mask(len(self.targets))
        width = self.max_loras * self.max_rank
        for index, rows in enumerate(self.part_rows):
            b = self.b[rows].view(-1, width)
            y[:, rows].addmm_(s[:, index * width : (index + 1) * width], b.t())
        return y


class LoraSlots:
    """Up to max_loras adapters on the device (slot 0: none), allocated once per adapted layer, so
    they keep their addresses: loading an adapter is a copy into a slot, and graphs captured with
    the slots read whatever adapter a slot holds when they replay."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, targets: Collection[str]) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets = tuple(t for t in TARGETS if t in targets)
        weight = model.embed.weight
        self.column_slot = torch.arange(1, max_loras + 1, device=weight.device).repeat_interleave(max_rank)
        self.dtype = weight.dtype
        self.linears: dict[tuple[int, str], LinearLora] = {}
        for i, block in enumerate(model.layers):
            for name, layer in (
                ("attn.qkv", block.attn.qkv),
                ("attn.o", block.attn.o),
                ("mlp.gate_up", block.mlp.gate_up),
                ("mlp.down", block.mlp.down),
            ):
                parts = [(t, part) for t, (owner, part) in TARGETS.items() if owner == name and t in self.targets]
                if parts:
                    layer.adapter = self.linears[(i, name)] = LinearLora(layer, parts, max_loras, max_rank)

    @property
    def nbytes(self) -> int:
        return sum(lin.a.nbytes + lin.b.nbytes for lin in self.linears.values())

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter into a slot (1..max_loras), in place; what it does not target stays zero."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot {slot} is not one of 1..{self.max_loras}")
        self.check(adapter)
        for (layer, _), linear in self.linears.items():
            linear.load(slot, adapter, layer)

    def check(self, adapter: LoraAdapter) -> None:
        """AdapterError when the adapter needs more than these slots give (`slot_refusal`)."""
        why = slot_refusal(adapter.targets, adapter.rank, self.targets, self.max_rank)
        if why:
            raise AdapterError(why)

    @contextlib.contextmanager
    def random_contents(self, seed: int) -> Iterator[None]:
        """Every slot filled with random adapters for a check, emptied after: for verifying graphs
        before any adapter is loaded (with empty slots, a graph that mixes up rows' slots could not
        be told from a right one)."""
        g = torch.Generator(self.column_slot.device).manual_seed(seed)
        for linear in self.linears.values():
            for t in (linear.a, linear.b):
                t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype) / t.shape[-1] ** 0.5)
        try:
            yield
        finally:
            for linear in self.linears.values():
                linear.a.zero_()
                linear.b.zero_()

    def batch(self, adapters: torch.Tensor) -> LoraBatch:
        return LoraBatch(adapters, self.column_slot, self.dtype)
