"""A soak of the server: Poisson arrivals, clients that hang up, malformed requests.

    python benchmarks/soak.py [--duration-s 1800] [--rate 1.0] [--model PATH]
    python benchmarks/soak.py --device cuda --model DIR --duration-s 600 --ramp 8 16 32 64 128

``nanoserve serve`` (the packaged SmolLM2 on the CPU by default) gets streamed completions
(prompts of 3-400 words, 16-128 tokens) arriving as a Poisson process; 20% of the clients
disconnect after a random number of chunks and 5% of the requests are malformed (each must be a
4xx). Then, idle,
``/metrics`` must show no running request and no KV block in use; a last burst of requests is
cut by a SIGTERM, which must drain them and exit 0. One JSON line: requests by outcome, 5xx
count (target 0), TTFT p50 / p99, the server's RSS after warm-up, each tenth of the run and
at the end (it grows while the KV cache's pages are first written, then should stay flat).
``--ramp R...``: first ``--ramp-s`` seconds at each rate, and the soak at the first rate whose
TTFT p99 is at least twice the first rate's (the last rate if none is).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
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


async def soak(url: str, duration_s: float, rate: float, seed: int, outcomes: Counter,
               ttfts: list[float], pid: int, rss: list[float]) -> None:
    """Requests for ``duration_s``; the server's RSS sampled each tenth of it into ``rss``."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:
        tasks, start = [], time.monotonic()
        while (elapsed := time.monotonic() - start) < duration_s:
            if elapsed >= len(rss) * duration_s / 10:
                rss.append(round(rss_mib(pid), 1))
            tasks.append(asyncio.create_task(one(c, url, random.Random(rng.random()),
                                                 outcomes, ttfts)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def p99_ms(ttfts: list[float]) -> float:
    return round(float(np.percentile(np.asarray(ttfts or [0.0]) * 1e3, 99)), 1)


def ramp(url: str, args: argparse.Namespace, outcomes: Counter, pid: int
         ) -> tuple[float, dict[float, float]]:
    """The soak's rate from ``--ramp`` (see the module's docstring) and each rate's p99."""
    p99s: dict[float, float] = {}
    for rate in args.ramp:
        ttfts: list[float] = []
        asyncio.run(soak(url, args.ramp_s, rate, args.seed, outcomes, ttfts, pid, []))
        p99s[rate] = p99_ms(ttfts)
        if p99s[rate] >= 2 * p99s[args.ramp[0]] > 0:
            return rate, p99s
    return args.ramp[-1], p99s


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
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 64 CPU, 256 GPU")
    parser.add_argument("--ramp", type=float, nargs="+", default=None, help="rates to try first")
    parser.add_argument("--ramp-s", type=float, default=20)
    parser.add_argument("--serve-args", default="", help="more flags of `nanoserve serve`")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/completions"
    seqs = args.max_num_seqs or (64 if args.device == "cpu" else 256)
    cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", "--device", args.device,
           "--port", str(port), "--no-ui", "--max-num-seqs", str(seqs)] \
        + (["--cpu-threads", str(args.threads)] if args.device == "cpu" else []) \
        + shlex.split(args.serve_args) + ([args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=Path("/tmp/soak.server.log").open("w"),
                            stderr=subprocess.STDOUT)
    outcomes: Counter = Counter()
    ttfts: list[float] = []
    ramp_p99s: dict[float, float] = {}
    try:
        wait_ready(base, proc)
        httpx.post(url, json={"prompt": "warm up", "max_tokens": 4}, timeout=60)
        rss: list[float] = []
        if args.ramp:
            args.rate, ramp_p99s = ramp(url, args, outcomes, proc.pid)
        asyncio.run(soak(url, args.duration_s, args.rate, args.seed, outcomes, ttfts, proc.pid,
                         rss))
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
        "device": args.device, "model": args.model, "duration_s": args.duration_s,
        "rate": args.rate, "ramp_ttft_p99_ms": ramp_p99s, "outcomes": dict(outcomes),
        "num_5xx": sum(n for k, n in outcomes.items() if "5xx" in k or k == "error event"),
        "ttft_p50_ms": round(float(np.median(ms)), 1),
        "ttft_p99_ms": p99_ms(ttfts),
        "rss_mib_each_tenth": rss,
        "running_when_idle": gauge(metrics, "num_requests_running"),
        "kv_cache_usage_when_idle": gauge(metrics, "kv_cache_usage_perc"),
        "exit_code_after_sigterm": exit_code}))


if __name__ == "__main__":
    main()
