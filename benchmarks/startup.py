"""Start-up time per phase: a fresh process imports nanoserve, builds `LLM(model)` and answers.

    python benchmarks/startup.py                  # the default model, caches as they are
    python benchmarks/startup.py --cold           # each run with an empty NANOSERVE_CACHE_DIR
    python benchmarks/startup.py --model m.gguf --repeats 5

Each run is a new Python process (imports are part of start-up); the engine's own phase lines
("<phase> in 1.23 s") give the phases inside `LLM()`. One JSON line per phase, the best of
the runs, then the process's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, logging, re, sys, time
T = time.perf_counter
start = T()
times, phases = {}, {}

class Phases(logging.Handler):
    def emit(self, record):
        m = re.match(r"(.+?) in (\d+\.\d+) s(:|$)", record.getMessage())
        if m:
            phases[m.group(1)] = float(m.group(2))

log = logging.getLogger("nanoserve")  # the engine then leaves logging as it is
log.addHandler(Phases()); log.setLevel(logging.INFO)
t = T(); import torch; times["import torch"] = T() - t
t = T(); import transformers; times["import transformers"] = T() - t
t = T()
from nanoserve import LLM, SamplingParams
import nanoserve.llm, nanoserve.models.asset_cache, nanoserve.runner.model_runner
times["import nanoserve"] = T() - t
t = T(); llm = LLM(sys.argv[1] if sys.argv[1] != "-" else None)
times["LLM()"] = T() - t
times["imports + LLM()"] = T() - start
t = T()
llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
             use_tqdm=False)
times["first generate (8 tokens)"] = T() - t
engine = phases.pop("engine ready")
inside = {"config + tokenizer": phases.pop("read the config and tokenizer"),
          "weights": phases.pop("loaded the weights"), "KV cache": phases.pop("sized the KV cache")}
inside["rest of the engine"] = engine - sum(inside.values()) - sum(phases.values())
print(json.dumps({**times, **inside, **phases}))
"""


def run_once(model: str, cold: bool) -> dict[str, float]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache:
        if cold:
            env["NANOSERVE_CACHE_DIR"] = cache
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, check=True,
                             capture_output=True, text=True).stdout
        wall = time.perf_counter() - start
    return {**json.loads(out.strip().splitlines()[-1]), "process wall": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="-", help="model path (default: the packaged one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true",
                        help="an empty asset cache each run (a first start after install)")
    args = parser.parse_args(argv)
    if not args.cold:
        run_once(args.model, cold=False)  # fills the caches: the runs below find them
    runs = [run_once(args.model, args.cold) for _ in range(args.repeats)]
    for phase in runs[0]:
        best = min(r[phase] for r in runs)
        print(json.dumps({"phase": phase, "seconds": round(best, 3), "cold": args.cold,
                          "runs": len(runs)}))


if __name__ == "__main__":
    main()
