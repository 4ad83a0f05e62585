"""What HTTP + streaming cost: offline LLM.generate vs the server at the same batch (CPU or GPU).

Runs the same random-token workload twice: through `LLM.generate` with max_num_seqs = C, then
through `nanoserve serve` (same engine flags) driven by `benchmarks/serve.py` at
max-concurrency C. Prints one JSON line with both output-token throughputs and their ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from nanoserve import LLM, SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_tok_s(model: str | None, engine_args: list[str], jobs: list[list[int]],
                  output_len: int, concurrency: int) -> float:
    extra = dict(zip(engine_args[::2], engine_args[1::2]))
    kwargs = {k.lstrip("-").replace("-", "_"): v for k, v in extra.items()}
    llm = LLM(model, max_num_seqs=concurrency, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(jobs[:2], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(jobs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.close()
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def served_tok_s(model: str | None, engine_args: list[str], num_prompts: int, input_len: int,
                 output_len: int, concurrency: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", *([model] if model else []),
           "--port", str(port), "--max-num-seqs", str(concurrency), *engine_args]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.5)
        bench = [sys.executable, str(Path(__file__).with_name("serve.py")),
                 "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", str(num_prompts),
                 "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                 "--max-concurrency", str(concurrency)]
        out = subprocess.run(bench, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        server.send_signal(2)
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("engine_args", nargs="*", help="extra engine flags, e.g. --dtype float32")
    args = parser.parse_args()
    rng = random.Random(0)
    jobs = [[rng.randrange(100, 1000) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]
    offline = offline_tok_s(args.model, args.engine_args, jobs, args.output_len, args.concurrency)
    served = served_tok_s(args.model, args.engine_args, args.num_prompts, args.input_len,
                          args.output_len, args.concurrency)
    print(json.dumps({"bench": "serve_overhead", "model": args.model or "SmolLM2-135M (default)",
                      "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                      "input_len": args.input_len, "output_len": args.output_len,
                      "offline_output_tok_s": round(offline, 1),
                      "served_output_tok_s": served.get("output_throughput"),
                      "served_over_offline": round(served.get("output_throughput", 0) / offline, 3),
                      "served": served, "cpus": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
