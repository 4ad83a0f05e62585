"""Online serving: TTFT, ITL, TPOT and throughput of a workload replayed against a running server.

Requests arrive as a Poisson process at ``--request-rate`` (inf: all at once), optionally
capped at ``--max-concurrency`` in flight, and stream their answers. Metrics follow vLLM's
benchmark_serving definitions:

- TTFT: request sent -> first streamed chunk carrying text.
- ITL: gap between successive text-carrying chunks of a request (all gaps, pooled).
- TPOT: (latency - TTFT) / (output tokens - 1), per request with more than one token.
- E2EL: request sent -> last byte; throughputs divide by the whole benchmark's wall time.

Output token counts come from the server's usage (``stream_options.include_usage``). One JSON
line is printed with mean / median / p99 of each latency (milliseconds) and the throughputs.

    nanoserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 512 --random-output-len 128 --request-rate 8
    nanoserve bench serve --dataset prompts.jsonl --endpoint chat --max-concurrency 32

A dataset is JSON lines with "prompt" (completions) or "messages" (chat), and "output_len".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class Job:
    body: dict[str, Any]  # the prompt / messages part of the request
    output_len: int


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    sent: float = 0.0  # perf_counter() when the request went out
    unanswered: bool = False  # the connection closed before any response came


_WORDS = ("time", "river", "stone", "light", "green", "quick", "model", "cloud", "paper",
          "north", "music", "bread", "glass", "storm", "field", "orbit", "table", "story")


def random_jobs(n: int, input_len: int, output_len: int, endpoint: str,
                rng: random.Random) -> list[Job]:
    """Synthetic prompts: token ids for completions (exact length), words for chat."""
    jobs = []
    for _ in range(n):
        if endpoint == "completions":
            body: dict[str, Any] = {"prompt": [rng.randrange(100, 1000) for _ in range(input_len)]}
        else:
            words = " ".join(rng.choice(_WORDS) for _ in range(input_len))
            body = {"messages": [{"role": "user", "content": words}]}
        jobs.append(Job(body, output_len))
    return jobs


def dataset_jobs(path: str, n: int, endpoint: str) -> list[Job]:
    key = "prompt" if endpoint == "completions" else "messages"
    jobs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                jobs.append(Job({key: row[key]}, int(row["output_len"])))
    return jobs[:n]


async def send(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
               chat: bool) -> Result:
    """One streamed request. One the server dropped unanswered (a kept-alive connection it
    had closed as the request went out, as llama-server does) is sent once more."""
    result = await _send_once(client, url, payload, chat)
    if result.unanswered:
        result = await _send_once(client, url, payload, chat)
    return result


async def _send_once(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                     chat: bool) -> Result:
    start = time.perf_counter()
    result = Result(ok=False, sent=start)
    last = start
    answered = False
    try:
        async with client.stream("POST", url, json=payload) as response:
            answered = True
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or [{}]
                text = (choices[0].get("delta", {}).get("content") if chat
                        else choices[0].get("text"))
                if not text:
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = result.ttft > 0.0
        result.error = "" if result.ok else "no text streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = repr(exc)
        result.unanswered = not answered and isinstance(exc, httpx.RemoteProtocolError)
    return result


async def run(args: argparse.Namespace, jobs: list[Job]) -> tuple[list[Result], float]:
    chat = args.endpoint == "chat"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(jobs)
    gate = asyncio.Semaphore(limit)
    rng = np.random.default_rng(args.seed)

    async with httpx.AsyncClient(timeout=None, headers=headers,
                                 limits=httpx.Limits(max_connections=limit)) as client:
        async def one(job: Job) -> Result:
            payload = {**job.body, "model": args.model, "max_tokens": job.output_len,
                       "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                       "stream": True, "stream_options": {"include_usage": True}}
            async with gate:
                return await send(client, url, payload, chat)

        start = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(one(job)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        for result in results:  # seconds into the run
            result.sent -= start
        return results, time.perf_counter() - start


def latency_series(done: list[Result]) -> dict[str, list[float]]:
    """vLLM's four latencies in seconds: per request TTFT, TPOT, E2EL; ITL per gap."""
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"ttft": [r.ttft for r in done], "tpot": tpot,
            "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done]}


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done), "failed": len(results) - len(done),
        "duration_s": round(duration, 3), "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    series = latency_series(done)
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"p99_{name}_ms"] = float(np.percentile(ms, 99))
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model name (default: the server's)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--dataset", default=None, help="JSON lines workload (see above)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly output_len tokens per request (default: yes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="also draw the latency CDFs and TTFT / ITL over the run")
    args = parser.parse_args(argv)

    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers).json()
        args.model = models["data"][0]["id"]
    jobs = dataset_jobs(args.dataset, args.num_prompts, args.endpoint) if args.dataset else \
        random_jobs(args.num_prompts, args.random_input_len, args.random_output_len,
                    args.endpoint, random.Random(args.seed))
    results, duration = asyncio.run(run(args, jobs))
    summary = summarize(results, duration)
    summary.update(model=args.model, endpoint=args.endpoint, num_prompts=len(jobs),
                   request_rate=str(args.request_rate), max_concurrency=args.max_concurrency)
    print(json.dumps(summary))
    if args.plot:
        from nanoserve.bench.plot import plot_serve

        done = [r for r in results if r.ok]
        plot_serve(latency_series(done), [(r.sent, r.ttft, r.itl) for r in done], summary,
                   args.plot)


if __name__ == "__main__":
    main()
