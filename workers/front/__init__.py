"""The request side of an engine: streams on an event loop, and the step loop they feed, in a thread
or in a child process of its own (`engine_process.py`). Above `serving/`, beside `protocol.py`."""
