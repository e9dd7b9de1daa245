"""What one model call needs and nothing above it: the typed inputs of a step (`step_inputs.py`).
Below `graphs/` (which captures and replays these calls) and above `modeling/` and `kv/`."""
