"""Where a checkpoint directory's tensors are (one safetensors file, or shards with an index), and
what its stored tensors say about its config."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from workers.modeling.checkpoint_dir import CheckpointError

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{model_dir}: index names weight files that are missing: {', '.join(missing)}")
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files{hint}")
    names: dict[str, Path] = {}
    for f in files:
        with opened(f) as sf:
            names.update(dict.fromkeys(sf.keys(), f))
    return names


@contextlib.contextmanager
def opened(path: Path):
    """A safetensors file, or a CheckpointError naming it (a truncated or damaged download)."""
    try:
        with safe_open(path, framework="pt") as sf:
            yield sf
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot be read as safetensors ({e}); a truncated or damaged file?") from e


def stores_untied_head(model_dir: Path) -> bool:
    """Whether the checkpoint stores an lm_head.weight other than its embedding: a fine-tune that
    untied the head while config.json still says tie_word_embeddings. transformers then keeps the
    two apart (and warns); serving the embedding as the head decoded other tokens. A directory
    without weight files says no (loading its weights refuses it later)."""
    try:
        files = weight_files(model_dir)
    except CheckpointError:
        return False
    if HEAD not in files or EMBEDDING not in files:
        return False
    with opened(files[HEAD]) as head_file, opened(files[EMBEDDING]) as embedding_file:
        head, embedding = head_file.get_tensor(HEAD), embedding_file.get_tensor(EMBEDDING)
    return head.shape != embedding.shape or not torch.equal(head, embedding)
