"""A soak of the server on the CPU: Poisson arrivals, clients that hang up, malformed requests.

    python benchmarks/cpu_soak.py [--duration-s 1800] [--rate 1.0] [--model PATH]

``nanoserve serve`` (the packaged SmolLM2 by default) gets streamed completions (prompts of
3-400 words, 16-128 tokens) arriving as a Poisson process; 20% of the clients disconnect after
a random number of chunks and 5% of the requests are malformed (each must be a 4xx). Then, idle,
``/metrics`` must show no running request and no KV block in use; a last burst of requests is
cut by a SIGTERM, which must drain them and exit 0. One JSON line: requests by outcome, 5xx
count (target 0), TTFT p50 / p99, the server's RSS after warm-up, each tenth of the run and
at the end (it grows while the KV cache's pages are first written, then should stay flat).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from cpu_llama_cpp import WORDS, free_port, wait_ready
from cpu_streams import gauge

MALFORMED = [
    b"{not json", b'{"prompt": "hi", "max_tokens": -3}', b'{"prompt": 7}',
    b'{"prompt": "hi", "temperature": "hot"}', b'{"prompt": "\\ud800"}',
    b'{"prompt": "hi", "n": 100000}', b'{"prompt": "hi", "logprobs": 1000}', b"[]",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, outcomes: Counter,
              ttfts: list[float]) -> None:
    if rng.random() < 0.05:
        body = rng.choice(MALFORMED)
        try:
            response = await client.post(url, content=body,
                                         headers={"content-type": "application/json"})
            outcomes[f"malformed {response.status_code // 100}xx"] += 1
        except httpx.HTTPError as exc:
            outcomes[f"malformed {type(exc).__name__}"] += 1
        return
    hang_up = rng.randint(1, 40) if rng.random() < 0.2 else None
    payload = {"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 400))),
               "max_tokens": rng.randint(16, 128), "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                outcomes[f"{response.status_code // 100}xx"] += 1
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if "error" in json.loads(line[6:]):
                    outcomes["error event"] += 1
                    return
                if chunks == 0:
                    ttfts.append(time.perf_counter() - start)
                chunks += 1
                if hang_up is not None and chunks >= hang_up:
                    outcomes["hung up"] += 1
                    return  # leaving the block closes the connection mid-stream
            outcomes["completed"] += 1
    except httpx.HTTPError as exc:
        outcomes[f"transport {type(exc).__name__}"] += 1


async def soak(url: str, args: argparse.Namespace, outcomes: Counter, ttfts: list[float],
               pid: int, rss: list[float]) -> None:
    """Requests for ``duration_s``; the server's RSS sampled each tenth of it into ``rss``."""
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:
        tasks, start = [], time.monotonic()
        while (elapsed := time.monotonic() - start) < args.duration_s:
            if elapsed >= len(rss) * args.duration_s / 10:
                rss.append(round(rss_mib(pid), 1))
            tasks.append(asyncio.create_task(one(c, url, random.Random(rng.random()),
                                                 outcomes, ttfts)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)


async def burst_then_sigterm(url: str, proc: subprocess.Popen, outcomes: Counter) -> None:
    async with httpx.AsyncClient(timeout=None) as client:
        payload = {"prompt": "one two three", "max_tokens": 32, "ignore_eos": True}
        tasks = [asyncio.create_task(client.post(url, json=payload)) for _ in range(5)]
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            key = (f"drain {result.status_code // 100}xx" if isinstance(result, httpx.Response)
                   else f"drain {type(result).__name__}")
            outcomes[key] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2 GGUF")
    parser.add_argument("--duration-s", type=float, default=1800)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/completions"
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--device", "cpu",
           "--port", str(port), "--cpu-threads", str(args.threads), "--no-ui",
           "--max-num-seqs", "64"] + ([args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=Path("/tmp/cpu_soak.server.log").open("w"),
                            stderr=subprocess.STDOUT)
    outcomes: Counter = Counter()
    ttfts: list[float] = []
    try:
        wait_ready(base, proc)
        httpx.post(url, json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
        rss: list[float] = []
        asyncio.run(soak(url, args, outcomes, ttfts, proc.pid, rss))
        time.sleep(2)  # the last aborts reach the engine
        metrics = httpx.get(base + "/metrics", timeout=10).text
        rss.append(round(rss_mib(proc.pid), 1))
        asyncio.run(burst_then_sigterm(url, proc, outcomes))
        exit_code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ms = np.asarray(ttfts or [0.0]) * 1e3
    print(json.dumps({
        "duration_s": args.duration_s, "rate": args.rate, "outcomes": dict(outcomes),
        "num_5xx": sum(n for k, n in outcomes.items() if "5xx" in k or k == "error event"),
        "ttft_p50_ms": round(float(np.median(ms)), 1),
        "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
        "rss_mib_each_tenth": rss,
        "running_when_idle": gauge(metrics, "num_requests_running"),
        "kv_cache_usage_when_idle": gauge(metrics, "kv_cache_usage_perc"),
        "exit_code_after_sigterm": exit_code}))


if __name__ == "__main__":
    main()
