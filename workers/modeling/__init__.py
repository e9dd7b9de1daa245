"""The model and its checkpoints: the Llama module, its tensor-parallel layers, checkpoint loading,
configs, LoRA slots, built-in models."""
