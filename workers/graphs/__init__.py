"""CUDA graphs: capture, replay, verification and online shadow verification of decode steps."""
