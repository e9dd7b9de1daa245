"""What a checkpoint directory must hold, read without torch: the architectures served, and the
tokenizer. A replica loads the tokenizer and never the model, so it imports this and not
`checkpoint.py`; transformers (which imports torch) is imported when a tokenizer is first loaded,
after the replica has started its engine process."""

from __future__ import annotations

from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served, with the reason in the message."""


def check_model_path(model: str) -> None:
    """That a `model` setting names what could be served (a directory with config.json, or a .gguf
    file), in microseconds: what a swap checks before it drains any request."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: no such .gguf file")
    elif not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    elif not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: missing config.json (not a checkpoint directory)")


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's own tokenizer (AutoTokenizer), with its chat template when it has one."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{model_dir}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (ValueError, OSError) as e:  # a damaged tokenizer.json is a JSONDecodeError, a ValueError
        raise CheckpointError(f"{model_dir}: its tokenizer cannot be loaded ({e})") from e
