"""Loading a Hugging Face checkpoint directory: config.json, safetensors weights, tokenizer.

Weights are read tensor by tensor through safetensors slices, and each slice goes straight to the
model layer that owns it, so a tensor-parallel rank reads only its share of every tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

import torch

from workers.modeling.config import CheckpointError, ModelConfig, load_config
from workers.modeling.model import LlamaModel
from workers.modeling.parallel import TPGroup
from workers.modeling.weight_files import opened, weight_files

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that a serving model derives or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes the weights may have; anything else (float8, int8 of a quantized export) is refused
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
REVISION_SAMPLE = 1 << 20


def model_revision(model_dir: Path) -> str:
    """A short content id of the checkpoint: config, and each weight file's name, size and first and
    last MiB (enough to tell two checkpoints of one shape apart without reading gigabytes)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as data:
            h.update(data.read(REVISION_SAMPLE))
            data.seek(max(0, size - REVISION_SAMPLE))
            h.update(data.read(REVISION_SAMPLE))
    return h.hexdigest()[:12]


def load_model(
    model_dir: str | Path,
    max_model_len: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    tp: TPGroup | None = None,
) -> LlamaModel:
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    with torch.device(device):
        model = LlamaModel(cfg, max_model_len, tp=tp)
    load_weights(model, model_dir)
    return model.eval()


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    """Copy a checkpoint's tensors into the model's existing parameters (this rank's shard of
    each): storage and addresses stay, so captured graphs read the new weights."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    targets = model.checkpoint_map()
    missing = sorted(set(targets) - set(files))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: weights missing from the checkpoint: {shown}")
    unused = [n for n in files if n not in targets and not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        log.warning("ignoring %d checkpoint tensors the model does not use, e.g. %s", len(unused), unused[0])
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():  # every tensor checked before any is copied: a swap in place
        with opened(path) as sf:  # that fails leaves the weights it had
            check_tensors(sf, path, names, model.cfg)
    for path, names in by_file.items():
        with opened(path) as sf:
            for name in names:
                module, kind, part = targets[name]
                tensor = sf.get_slice(name)

                def read(dim: int | None, start: int, stop: int, tensor=tensor) -> torch.Tensor:
                    if dim is None:
                        return tensor[:]
                    return tensor[start:stop] if dim == 0 else tensor[:, start:stop]

                module.load(kind, part, read)


def check_tensors(sf, path: Path, names: list[str], cfg: ModelConfig) -> None:
    """Each of `names` is in the file, a float tensor, of the shape config.json implies."""
    present = set(sf.keys())
    for name in names:
        if name not in present:
            raise CheckpointError(f"{path}: has no tensor {name}, though the index maps it to this file")
        tensor = sf.get_slice(name)
        dtype, shape = tensor.get_dtype(), tuple(tensor.get_shape())
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"{name} in {path.name} is {dtype}: quantized weights are not supported "
                "(serve the unquantized bf16, fp16 or fp32 checkpoint)"
            )
        expected = cfg.tensor_shape(*name.rsplit(".", 2)[-2:])
        if shape != expected:
            raise CheckpointError(
                f"{name} in {path.name} has shape {list(shape)}, config.json implies {list(expected)} "
                f"(vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, "
                f"intermediate_size={cfg.intermediate_size}, {cfg.num_heads} heads and {cfg.num_kv_heads} "
                f"kv heads of head_dim {cfg.head_dim})"
            )
