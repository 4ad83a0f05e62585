"""Many streams on the CPU: the server against the offline engine on the same requests.

    python benchmarks/cpu_streams.py [--num-prompts 200] [--threads 2] [--model PATH]

The workload (issue 46): prompts of 3-400 words, each asking for 16-128 tokens (greedy,
``ignore_eos``), all sent at once. The offline ``LLM`` generates them in one call; then
``nanoserve serve`` (same model, threads and ``max_num_seqs``) serves them streamed through
``/v1/completions``. Afterwards the server's ``/metrics`` must show no running request and no
KV block in use, and a SIGTERM must end it with exit code 0. One JSON line per run, then the
ratio of the server's output throughput to the offline engine's.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cpu_llama_cpp import WORDS, free_port, measure, wait_ready

from nanoserve import LLM, SamplingParams
from nanoserve.bench.serve import Job


def workload(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 400)))},
                rng.randint(16, 128)) for _ in range(n)]


def offline(args: argparse.Namespace, jobs: list[Job]) -> dict:
    llm = LLM(args.model, device="cpu", max_num_seqs=len(jobs), cpu_threads=args.threads)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=j.output_len, ignore_eos=True)
                  for j in jobs]
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([j.body["prompt"] for j in jobs], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"completed": len(outs), "total_output_tokens": tokens, "duration_s": round(seconds, 3),
            "output_throughput": round(tokens / seconds, 3)}


def gauge(metrics: str, name: str) -> float:
    match = re.search(rf"^nanoserve:{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def served(args: argparse.Namespace, jobs: list[Job]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--device", "cpu",
           "--port", str(port), "--max-num-seqs", str(len(jobs)),
           "--cpu-threads", str(args.threads), "--no-ui"] + ([args.model] if args.model else [])
    log = Path("/tmp/cpu_streams.server.log")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        measure(url, workload(2, seed=1)[:2], None)  # warm-up
        summary = measure(url, jobs, None)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        summary["running_after"] = gauge(metrics, "num_requests_running")
        summary["kv_cache_usage_after"] = gauge(metrics, "kv_cache_usage_perc")
        proc.send_signal(signal.SIGTERM)
        summary["exit_code_after_sigterm"] = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2 GGUF")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    jobs = workload(args.num_prompts, args.seed)
    base = offline(args, jobs)
    print(json.dumps({"run": "offline", **base}), flush=True)
    online = served(args, jobs)
    print(json.dumps({"run": "server", **online}), flush=True)
    print(json.dumps({"server_over_offline": round(
        online["output_throughput"] / base["output_throughput"], 3)}))


if __name__ == "__main__":
    main()
