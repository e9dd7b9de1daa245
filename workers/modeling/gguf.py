"""GGUF checkpoints (llama.cpp's single-file format), served by converting them once: transformers
dequantizes the file, and its weights (in bf16), config, tokenizer and chat template are written as
an ordinary safetensors checkpoint in the cache, which the normal loading path then serves.

transformers refuses `save_pretrained` on a model loaded from GGUF, so the files are written here.
The conversion is keyed by a content id of the GGUF file, and published atomically (replicas may
race to convert the same file). torch and transformers are imported only to convert: naming the
converted directory of a file converted before needs neither.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from workers.modeling.checkpoint_dir import SUPPORTED_ARCHITECTURES, CheckpointError

log = logging.getLogger(__name__)
SAMPLE = 1 << 20  # bytes read from each end of the file for its content id
FORMAT = 2  # of what a conversion writes; a new one converts again (2: config without quantization_config)


def content_id(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}:{FORMAT}".encode())
    with path.open("rb") as data:
        h.update(data.read(SAMPLE))
        data.seek(max(0, size - SAMPLE))
        h.update(data.read(SAMPLE))
    return h.hexdigest()[:12]


def converted(gguf_file: Path, cache: Path) -> Path:
    """The safetensors checkpoint of a GGUF file, converting it on first use (needs the `gguf`
    package); CheckpointError when it is not a Llama-family model or cannot be read."""
    if not gguf_file.is_file():
        raise CheckpointError(f"{gguf_file}: no such GGUF file")
    target = cache / "gguf" / f"{gguf_file.stem}-{content_id(gguf_file)}"
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf_file, target)
    try:
        # float32: the dequantized weights come out dense (other dtypes keep them packed)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (OSError, ValueError, ImportError) as e:
        raise CheckpointError(f"{gguf_file}: cannot be read as a GGUF checkpoint ({e})") from e
    config, architecture = model.config, type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf_file}: {architecture} is not a supported architecture; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config.architectures = [architecture]
    config.dtype = "bfloat16"
    # the weights written are dense: a config still naming GGUF quantization would make transformers
    # load this checkpoint as packed GGUF weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {
        name: t.to(torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    config.save_pretrained(tmp)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process published it first: the same content
    return target
