"""What a model call needs and nothing above it: its typed inputs (`step_inputs.py`), the static
buffers graphs read and the calls on them (`runner.py` for decode, `prefill_pieces.py` for the
prefill cut at attention). Below `graphs/` (which captures and replays these calls) and above
`modeling/` and `kv/`."""
