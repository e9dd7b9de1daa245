"""The model and its checkpoints: the Llama module, checkpoint loading, configs, built-in models."""
