"""What one message costs to cross between Serve processes, by encoding: a dict of the same fields
(what the ingress and the replicas exchanged before), the typed struct pickled by Ray, and the
struct as msgpack bytes (what they exchange now, `workers/protocol.py`): Ray's own serialize of
each, in one process, and msgspec's encode and decode, for a request and for a stream chunk.

    python -m bench.message_codec --out bench/results/message_codec.json
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path

import msgspec
import ray

from workers.protocol import ChoiceChunk, GenerateRequest, decode_item, decode_request, encode
from workers.serving.detokenizer import DetokState
from workers.serving.sampling import SamplingParams

CHUNK = ChoiceChunk(0, " hello", None, 130, 0, 17, [1234], 123456789, DetokState(10, 12, ""), "a1b2c3d4e5f6")
REQUEST = GenerateRequest(
    "tenant-a",
    "chat",
    SamplingParams(temperature=0.7, stop=("\n\n",)),
    256,
    messages=[{"role": "user", "content": "hi"}],
)


def as_dict(message) -> dict:
    fields = msgspec.structs.asdict(message)
    if isinstance(message, GenerateRequest):
        fields["sampling"] = dict(message.sampling.__dict__)
    return fields


def serialize_us(context, value, number: int = 5000) -> float:
    return timeit.timeit(lambda: context.serialize(value), number=number) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    context = ray._private.worker.global_worker.get_serialization_context()
    rows = []
    for name, message, decode in (("request", REQUEST, decode_request), ("chunk", CHUNK, decode_item)):
        number = 5000
        encode_us = timeit.timeit(lambda m=message: encode(m), number=number) / number * 1e6
        wire = encode(message)
        decode_us = timeit.timeit(lambda w=wire, d=decode: d(w), number=number) / number * 1e6
        rows.append(
            {
                "message": name,
                "dict_serialize_us": serialize_us(context, as_dict(message)),
                "struct_serialize_us": serialize_us(context, message),
                "msgpack_serialize_us": serialize_us(context, wire),
                "msgpack_encode_us": encode_us,
                "msgpack_decode_us": decode_us,
                "msgpack_bytes": len(wire),
            }
        )
    ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "| message | dict, Ray serialize | struct, Ray serialize | msgpack bytes, Ray serialize "
        "| msgpack encode | msgpack decode | bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['message']} | {r['dict_serialize_us']:.1f} us | {r['struct_serialize_us']:.1f} us "
            f"| {r['msgpack_serialize_us']:.2f} us | {r['msgpack_encode_us']:.2f} us | {r['msgpack_decode_us']:.2f} us "
            f"| {r['msgpack_bytes']} |"
        )
    args.out.with_suffix(".md").write_text(
        "# Message encoding between Serve processes\n\n`python -m bench.message_codec --out "
        "bench/results/message_codec.json` (this machine, 2 CPU cores; Ray's serializer in-process).\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
