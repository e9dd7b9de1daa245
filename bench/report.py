"""Where a benchmark's results go: its JSON, and beside it (same name, `.md`) the markdown table,
with the command that produced it and the machine and torch it ran on."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def invocation() -> str:
    """How this benchmark was started: `python -m bench.NAME` (as the docs run them, from the
    repository root), or the script's path where it was run as a file."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return f"python -m {spec.name}" if spec is not None else f"python {Path(sys.argv[0]).as_posix()}"


def write_report(out: str | Path, result: dict, table: str, note: str = "") -> None:
    """`result["meta"]` names the device and torch; `note` goes between the table and the command."""
    out, meta = Path(out), result["meta"]
    out.write_text(json.dumps(result, indent=1))
    command = f"{invocation()} {' '.join(sys.argv[1:])}".strip()
    out.with_suffix(".md").write_text(f"{table}\n\n{note}`{command}` on {meta['device']}, torch {meta['torch']}\n")
    print(table)
