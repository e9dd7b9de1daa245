"""Where a warm engine start goes, without Ray Serve around it: the 1B shape (random bf16 weights)
written once, then three fresh processes start an engine on one compile cache directory (the GPU
defaults: 256 sequences, the 17-bucket ladder, compile on, max_model_len 8192): cold, warm, and warm
under cProfile. Each prints its import time, `LLMEngine.from_config`'s time and the engine's phases;
the profiled one also its 70 costliest calls by cumulative time and 30 by own time. Compare with
`startup.py`'s rows through the Serve app.

    python -m bench.engine_start_profile > bench/results/engine_start_profile_h200.txt
"""

import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path

MODEL, CACHE = Path("/tmp/prof/m1b"), Path("/tmp/prof/cc")


def start(profile: bool) -> None:
    t0 = time.perf_counter()
    from policies.graph_policy import GraphPolicy
    from workers.serving.engine import LLMEngine
    from workers.serving.engine_config import EngineConfig

    t_import = time.perf_counter() - t0
    config = EngineConfig(
        model=str(MODEL),
        max_model_len=8192,
        max_num_seqs=256,
        compile_cache_dir=str(CACHE),
        max_prefill_delay_ms=8.0,
        graph_policy=GraphPolicy(compile=True),
    )
    pr = cProfile.Profile()
    if profile:
        pr.enable()
    t1 = time.perf_counter()
    engine, _ = LLMEngine.from_config(config)
    total = time.perf_counter() - t1
    pr.disable()
    print(json.dumps({"import_s": t_import, "from_config_s": total, "startup": engine.status().startup}, default=str))
    if profile:
        s = io.StringIO()
        st = pstats.Stats(pr, stream=s)
        st.sort_stats("cumulative").print_stats(70)
        st.sort_stats("tottime").print_stats(30)
        print(s.getvalue())


if __name__ == "__main__":
    if len(sys.argv) > 1:
        start(sys.argv[1] == "profile")
    else:
        from bench.startup import write_model

        t = time.perf_counter()
        write_model("1b", MODEL)
        print("write", time.perf_counter() - t, flush=True)
        for mode in ("cold", "warm", "profile"):
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "bench.engine_start_profile", mode], capture_output=True, text=True
            )
            print(mode, "wall", time.perf_counter() - t, flush=True)
            print(out.stdout[-20000:] if mode == "profile" else out.stdout[-3000:], out.stderr[-1500:], flush=True)
