"""GGUF checkpoints (llama.cpp's single-file format), served by converting them once: transformers
dequantizes the file, and its weights, config, tokenizer and chat template are written as an
ordinary safetensors checkpoint in the cache, which the normal loading path then serves.

A file of float tensors (F32, F16, BF16) converts without loss: each tensor is stored in the
narrowest float type that holds its values exactly, and the checkpoint's dtype (what is served
when `dtype` is not set) is the one holding most of its weights, so an F32 file is served in fp32,
as llama.cpp and transformers compute it. A quantized file's dequantized weights are stored in
bf16 (exact would take fp32, 8x the room of a 4-bit file).

transformers refuses `save_pretrained` on a model loaded from GGUF, so the files are written here.
What transformers leaves out of its reading is taken from the file's own metadata: rope scaling
(linear, or Llama 3.1's as llama.cpp stores it, a `rope_freqs` tensor of per-frequency factors) and
the end-of-turn tokens a chat model stops at; a file missing tensors the model needs (one shard of a
split file, a damaged export) is refused, not filled with random weights.

The conversion is keyed by a hash of the whole file, remembered per file version (size, mtime,
inode) so a multi-GB file is read once a version, and published atomically (replicas may race to
convert the same file). torch and transformers are imported only to convert: naming the converted
directory of a file converted before needs neither.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

from workers.modeling.checkpoint_dir import SUPPORTED_ARCHITECTURES, CheckpointError

log = logging.getLogger(__name__)
FORMAT = 4  # of what a conversion writes; a new one converts again (4: float files kept exact)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192  # Llama 3.1-3.3's


def content_id(path: Path, cache: Path) -> str:
    """A hash of the file's whole content (and the conversion's format): two files that differ
    anywhere are two conversions. Remembered in the cache per file version, so a start reads the
    file again only when it changed."""
    stat = path.stat()
    version = [stat.st_size, stat.st_mtime_ns, stat.st_ino, FORMAT]
    memo = cache / "gguf" / "ids" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]}.json"
    try:
        known = json.loads(memo.read_text())
        if known["version"] == version:
            return known["id"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.sha256(f"graphserve-gguf-{FORMAT}:".encode())
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 24), b""):
            h.update(block)
    found = h.hexdigest()[:12]
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"path": str(path), "version": version, "id": found}))
        tmp.replace(memo)
    except OSError:  # a read-only cache: the hash is computed again next time
        pass
    return found


def converted(gguf_file: Path, cache: Path) -> Path:
    """The safetensors checkpoint of a GGUF file, converting it on first use (needs the `gguf`
    package); CheckpointError when it is not a Llama-family model or cannot be read."""
    if not gguf_file.is_file():
        raise CheckpointError(f"{gguf_file}: no such GGUF file")
    target = cache / "gguf" / f"{gguf_file.stem}-{content_id(gguf_file, cache)}"
    if (target / "config.json").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf_file, target)
    facts = _metadata(gguf_file)
    try:
        # float32: the dequantized weights come out dense (other dtypes keep them packed)
        model, loading = AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, output_loading_info=True
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as e:  # whatever transformers' reader raised: the file is what it could not take
        raise CheckpointError(f"{gguf_file}: cannot be read as a GGUF checkpoint ({type(e).__name__}: {e})") from e
    config, architecture = model.config, type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf_file}: {architecture} is not a supported architecture; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    missing = set(loading["missing_keys"])
    if "lm_head.weight" in missing:  # no output tensor: llama.cpp reads the embedding as the head
        config.tie_word_embeddings = True
    missing.discard("lm_head.weight")
    if missing:
        names = ", ".join(sorted(missing)[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{gguf_file}: the file lacks {len(missing)} of the model's tensors ({names})")
    config.architectures = [architecture]
    # the weights written are dense: a config still naming GGUF quantization would make transformers
    # load this checkpoint as packed GGUF weights
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {
        name: (t.to(torch.bfloat16) if facts["quantized"] else _narrowest_exact(t)).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    config.dtype = str(_most_weights(weights)).removeprefix("torch.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    config.save_pretrained(tmp)
    _add_what_transformers_leaves_out(tmp, facts, gguf_file)
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process published it first: the same content
    return target


def _narrowest_exact(t):
    """`t` (float32) in bf16 or fp16 where that holds every value exactly, else as it is."""
    import torch

    for dtype in (torch.bfloat16, torch.float16):
        narrow = t.to(dtype)
        if torch.equal(narrow.float(), t):
            return narrow
    return t


def _most_weights(weights: dict):
    """The dtype that holds most of the weights' values."""
    count: dict = {}
    for t in weights.values():
        count[t.dtype] = count.get(t.dtype, 0) + t.numel()
    return max(count, key=count.get)


def _metadata(gguf_file: Path) -> dict:
    """What the conversion reads from the file itself: its split count, rope scaling (metadata, and
    llama.cpp's `rope_freqs` factors), rope base and dimension, its end-of-sequence and
    end-of-turn token ids, and whether any tensor is quantized."""
    import gguf

    try:
        reader = gguf.GGUFReader(gguf_file)

        def value(key: str, default=None):
            field = reader.fields.get(key)
            return default if field is None else field.contents()

        arch = value("general.architecture", "llama")
        facts = {
            "split": value("split.count", 1),
            "scaling": value(f"{arch}.rope.scaling.type"),
            "factor": value(f"{arch}.rope.scaling.factor"),
            "original_context": value(f"{arch}.rope.scaling.original_context_length"),
            "rope_base": value(f"{arch}.rope.freq_base", 10000.0),
            "rope_dims": value(f"{arch}.rope.dimension_count"),
            "end_ids": [value(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")],
        }
        freqs = next((t.data for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        facts["rope_freqs"] = None if freqs is None else [float(x) for x in freqs.reshape(-1)]
        floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
        facts["quantized"] = any(t.tensor_type not in floats for t in reader.tensors)
    except Exception as e:  # a header cut short, a damaged field: not a readable GGUF file
        raise CheckpointError(f"{gguf_file}: cannot be read as a GGUF checkpoint ({type(e).__name__}: {e})") from e
    if facts["split"] > 1:
        raise CheckpointError(
            f"{gguf_file}: one of {facts['split']} files of a split GGUF model (gguf-split); merge them into one "
            "first (llama-gguf-split --merge FIRST_FILE OUT.gguf)"
        )
    facts["end_ids"] = [i for i in facts["end_ids"] if i is not None]
    return facts


def _add_what_transformers_leaves_out(checkpoint: Path, facts: dict, gguf_file: Path) -> None:
    """Rope scaling into config.json (transformers drops it), and a generation_config.json whose
    end-of-sequence ids hold the end-of-turn tokens (Llama 3's `<|eot_id|>`) a chat model stops at."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text())
    rope = _rope_scaling(facts, config, gguf_file)
    if rope:
        config["rope_scaling"] = rope
        config["rope_theta"] = facts["rope_base"]
        if "rope_parameters" in config:
            config["rope_parameters"] = {**rope, "rope_theta": facts["rope_base"]}
        path.write_text(json.dumps(config, indent=2))
    end_ids = list(dict.fromkeys(facts["end_ids"]))
    if end_ids:
        (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": end_ids}, indent=2))


def _rope_scaling(facts: dict, config: dict, gguf_file: Path) -> dict | None:
    """The rope scaling the file asks for, as a transformers config says it; CheckpointError for one
    graphserve does not serve (it would decode with the wrong positions, silently)."""
    if facts["rope_freqs"] is not None:
        return _llama3_scaling(facts, config, gguf_file)
    kind = facts["scaling"]
    if kind in (None, "none") or facts["factor"] in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(facts["factor"])}
    raise CheckpointError(f"{gguf_file}: rope scaling {kind!r} is not supported (linear and Llama 3.1's are)")


def _llama3_scaling(facts: dict, config: dict, gguf_file: Path) -> dict:
    """Llama 3.1's rope scaling from llama.cpp's per-frequency factors: the settings every Llama
    3.1-3.3 uses (the largest factor as `factor`), accepted only when they give the file's factors."""
    factors = facts["rope_freqs"]
    dims = facts["rope_dims"] or config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = max(factors)
    original = facts["original_context"] or LLAMA3_ORIGINAL_CONTEXT
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    expected = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * facts["rope_base"] ** (i / dims)
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if len(expected) != len(factors) or any(not math.isclose(a, b, rel_tol=1e-3) for a, b in zip(expected, factors)):
        raise CheckpointError(
            f"{gguf_file}: its rope_freqs tensor (per-frequency rope scaling) is not Llama 3.1's; it is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
