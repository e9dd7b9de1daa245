"""The compile cache directory: one subdirectory of `compile_cache_dir` per thing that was compiled.

A warm start reads inductor's compiled decode step (and Triton's kernels, ours included) from disk
instead of compiling: 26 s instead of 187 s measured for the 1B shape. The directory is a volume
that every replica of a deployment mounts, so one replica's compile serves the others and later
starts, and several deployments, models or versions may share it. Each start uses the
subdirectory named by a hash of everything that decides what is compiled: the model's config and
length, the tensor-parallel size, the engine settings that shape the step (attention backend, page
size, batch limit, graph policy, LoRA slots) and the versions of Python, torch, CUDA and Triton and
the device. A changed input never reads an artifact made for another; what it made before stays
in its own directory (to delete by hand once unused). Inductor keys its own entries within the
directory too (the graph's code, input shapes, its config), so also what the hash leaves out, such
as the KV pool's page count (sized from free memory), cannot load a stale graph.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

import torch

KEY_FILE = "key.json"  # in each subdirectory: what its name is the hash of, for operators


def versions(device: torch.device) -> dict[str, str | None]:
    """The software and hardware a compiled artifact is only valid for."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        hardware = f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"
    else:
        hardware = f"{device.type} {platform.machine()}"
    return {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "device": hardware,
    }


def cache_key(inputs: dict) -> str:
    """The subdirectory's name: a hash of the key inputs (order of keys does not matter)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def use_compile_cache(root: str | Path, inputs: dict) -> Path:
    """Point inductor and Triton at the subdirectory of `root` for these inputs (made if missing,
    with its key file) for the rest of this process; both read the variables when they compile."""
    directory = Path(root) / cache_key(inputs)
    directory.mkdir(parents=True, exist_ok=True)
    key_file = directory / KEY_FILE
    if not key_file.exists():  # replicas sharing the volume may race here: each writes the same text
        tmp = directory / f".{KEY_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(inputs, indent=1, sort_keys=True))
        tmp.replace(key_file)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    return directory
