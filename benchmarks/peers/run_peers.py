"""Runs llama.cpp and nanoserve, one after the other, on one random GGUF and the same workloads.

    python benchmarks/peers/run_peers.py --shape qwen3-0.6b [--shape qwen3-8b]   # on the H200
    python benchmarks/peers/run_peers.py --dry-run [--llama-bin DIR]             # CPU check

On the H200 (issue 45; carry .cache/peers/llama-cpp-cuda.tar.xz, .cache/peers/wheels and
.cache/peers/qwen3-tokenizer.tar.xz, staged by stage_llama_cpp.sh): installs the wheels the
image lacks (pip --no-index --no-deps --target WORK/site, only those not importable), unpacks
llama.cpp (libcudart/libcublas from torch's nvidia wheels through LD_LIBRARY_PATH), writes the
shape as a bf16 GGUF of random weights (random_gguf.py), then per shape and engine, each part
time-boxed:

- throughput: nano-vLLM's workload (throughput.py's prompts of random ids, randint(100, max
  input) long, max_tokens randint(100, max output), ignore_eos), greedy. The same requests go
  to both servers' /v1/completions at once, unstreamed (llama-server with one slot per
  request, continuous batching): the comparable pair. nanoserve's LLM.generate on them too
  (its offline API; llama.cpp has none for mixed lengths).
- uniform: PL prompts of PP random ids, TG tokens each: llama-batched-bench against
  nanoserve's LLM.generate (output tokens / total seconds, prefill included, on both).
- decode: batch-1 ms per token after a context of 128 and 2048 tokens: llama-bench -d C -n N
  (1000 / its tokens/s) against nanoserve as latency.py times it ((t(N) - t(1)) / (N - 1)).
- serve: Poisson arrivals at a fixed rate, streamed /v1/completions (nanoserve.bench.serve's
  client): TTFT and ITL p50/p99 against llama-server and `nanoserve serve`.

Greedy everywhere, bf16 weights on both (llama.cpp's KV cache f16, nanoserve's bf16), flash
attention on in llama.cpp. One JSON line per (engine, workload) on stdout and in
OUT/peers.jsonl, then a markdown table with nanoserve / llama.cpp ratios (OUT/peers.md);
OUT/peers.log holds the engines' logs. OUT is $OUT, else /tmp/peers-out.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "peers"
LOG: list[str] = []  # peers.log, written at the end (and on each part)
T0 = time.perf_counter()

# Wheel (distribution) -> module that tells whether the image has it; a group installs whole
# where any of it is missing (their versions pin each other).
MODULES = {"opentelemetry_api": "opentelemetry.trace"}
GROUPS = [{"fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types",
           "typing_inspection", "annotated_doc"}, {"httpx", "httpcore", "h11", "anyio"}]


def log(msg: str) -> None:
    line = f"[peers +{time.perf_counter() - T0:6.1f}s] {msg}"
    print(line, file=sys.stderr, flush=True)
    LOG.append(line)


# ---- setup -----------------------------------------------------------------------------------

def install_wheels(wheels: Path, site: Path) -> None:
    """pip --no-index --no-deps --target ``site`` of the wheels whose module is missing here."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    dist = {f: f.name.split("-")[0].lower() for f in files}
    missing = {d for d in dist.values()
               if importlib.util.find_spec(MODULES.get(d, d).split(".")[0]) is None
               or (d in MODULES and _no_spec(MODULES[d]))}
    for group in GROUPS:
        if missing & group:
            missing |= group & set(dist.values())
    todo = [str(f) for f, d in dist.items() if d in missing]
    if todo:
        log(f"installing {len(todo)} wheels into {site}: {' '.join(sorted(missing))}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--disable-pip-version-check", "--target", str(site), *todo], check=True)
    else:
        log(f"wheels: nothing missing ({len(files)} staged)")
    if site.is_dir():
        sys.path.insert(0, str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def _no_spec(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def nvidia_lib_dirs() -> list[str]:
    """Folders with libcudart.so.13 / libcublas.so.13 for llama.cpp: torch's CUDA wheels'
    (site-packages/nvidia/*/lib), then the toolkit's where the image has one."""
    dirs: list[str] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        dirs += sorted(d for d in glob.glob(os.path.join(root, "*", "lib")) if os.path.isdir(d))
    for lib in ("libcudart.so.13", "libcublas.so.13"):
        if not any(os.path.exists(os.path.join(d, lib)) for d in dirs):
            dirs += sorted({os.path.dirname(f) for p in sys.path if p
                            for f in glob.glob(os.path.join(p, "**", lib), recursive=True)})
    dirs += [d for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
             if os.path.isdir(d)]
    return list(dict.fromkeys(dirs))


def unpack_llama(args: argparse.Namespace) -> Path | None:
    if args.llama_bin:
        return Path(args.llama_bin)
    tarball = Path(args.llama_tar)
    if not tarball.is_file():
        log(f"no {tarball}: llama.cpp skipped")
        return None
    dest = Path(args.work) / "llama-cpp-cuda"
    if not (dest / "llama-server").exists():
        with tarfile.open(tarball) as tar:
            tar.extractall(Path(args.work), filter="tar" if hasattr(tarfile, "tar_filter")
                           else None)
    libs = [str(dest), *nvidia_lib_dirs()]
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(
        libs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    version = (dest / "VERSION").read_text().splitlines()[0] if (dest / "VERSION").is_file() \
        else "?"
    log(f"llama.cpp: {version}; LD_LIBRARY_PATH={os.environ['LD_LIBRARY_PATH']}")
    ldd = subprocess.run(["ldd", str(dest / "llama-server")], capture_output=True, text=True,
                         check=False)
    lost = [line.strip() for line in ldd.stdout.splitlines() if "not found" in line]
    if lost:
        log("llama-server lacks: " + "; ".join(lost))
    return dest


def tokenizer_dir(args: argparse.Namespace) -> Path:
    """Qwen3's tokenizer: .cache/qwen3-tokenizer, else unpacked from the staged tar.xz."""
    for cand in (Path(args.tokenizer), ROOT / ".cache" / "qwen3-tokenizer"):
        if (cand / "tokenizer.json").is_file():
            return cand
    packed = CACHE / "qwen3-tokenizer.tar.xz"
    dest = Path(args.work)
    with tarfile.open(packed) as tar:
        tar.extractall(dest)
    return dest / "qwen3-tokenizer"


def write_gguf(args: argparse.Namespace, shape: str, tok: Path) -> Path:
    path = Path(args.work) / f"{shape}{f'-l{args.layers}' if args.layers else ''}.gguf"
    if path.is_file() and not args.rewrite_gguf:
        log(f"{path} already there")
        return path
    cmd = [sys.executable, str(HERE / "random_gguf.py"), shape, str(path), "--tokenizer", str(tok)]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    if args.device == "cpu":
        cmd += ["--device", "cpu"]
    subprocess.run(cmd, check=True, env=child_env())
    return path


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ---- processes -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_logged(name: str, cmd: list[str], timeout: float, env: dict | None = None
               ) -> tuple[int | None, str]:
    """Run ``cmd`` (its own process group) for at most ``timeout`` s: (exit code or None on
    timeout, its output); the output's tail goes to the log."""
    log(f"{name}: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        stop(proc)
        out, _ = proc.communicate()
        code = None
    tail = out.splitlines()[-40:]
    LOG.extend(f"  {name}| {line}" for line in tail)
    log(f"{name}: exit {code if code is not None else 'timeout'}")
    return code, out


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group we started, SIGKILL after 15 s."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


class Server:
    """A server subprocess (own process group), its output in a log file, stopped on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, work: Path, env: dict | None = None):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.logfile = work / f"{name}.log"
        log(f"{name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=self.logfile.open("w"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                last = self.logfile.read_text(errors="replace").strip().splitlines()[-2:]
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: "
                                   + " | ".join(last)[-300:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    log(f"{self.name}: ready")
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s")

    def model(self) -> str:
        import httpx
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)
        lines = self.logfile.read_text(errors="replace").splitlines()
        LOG.extend(f"  {self.name}| {line}" for line in lines[:25] + ["..."] + lines[-25:])


# ---- workloads -------------------------------------------------------------------------------

def throughput_workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    from nanoserve.bench.floor import throughput_requests
    return throughput_requests(args.num_seqs, args.max_input_len, args.max_output_len, args.seed)


def uniform_workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed + 1)
    return [[rng.randrange(100, 10000) for _ in range(args.uniform_pp)]
            for _ in range(args.uniform_pl)]


def decode_prompt(context: int) -> list[int]:
    rng = random.Random(context)
    return [rng.randrange(10000) for _ in range(context)]


def serve_jobs(args: argparse.Namespace) -> list:
    from nanoserve.bench.serve import random_jobs
    return random_jobs(args.serve_prompts, args.serve_input_len, args.serve_output_len,
                       "completions", random.Random(args.seed))


async def _http_throughput(url: str, model: str, prompts: list[list[int]],
                           max_tokens: list[int]) -> tuple[float, int, list[str]]:
    """All requests at once, unstreamed: (seconds, output tokens, errors)."""
    import httpx
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(
            max_connections=len(prompts))) as client:
        async def one(prompt: list[int], n: int) -> tuple[int, str]:
            body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True, "stream": False}
            try:
                r = await client.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    return 0, f"HTTP {r.status_code}: {r.text[:200]}"
                usage = r.json().get("usage") or {}
                return int(usage.get("completion_tokens", n)), ""
            except httpx.HTTPError as exc:
                return 0, repr(exc)
        start = time.perf_counter()
        done = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
        seconds = time.perf_counter() - start
    return seconds, sum(n for n, _ in done), sorted({e for _, e in done if e})[:3]


def http_throughput(server: Server, args: argparse.Namespace, engine: str) -> dict:
    prompts, max_tokens = throughput_workload(args)
    model = server.model()
    asyncio.run(_http_throughput(server.url, model, prompts[:4], [8] * 4))  # warm-up
    seconds, produced, errors = asyncio.run(asyncio.wait_for(
        _http_throughput(server.url, model, prompts, max_tokens), args.part_timeout))
    rec = record(engine, "throughput-http", num_seqs=args.num_seqs,
                 max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                 output_tokens=produced, expected_output_tokens=sum(max_tokens),
                 seconds=round(seconds, 3), output_tok_s=round(produced / seconds, 1))
    if errors:
        rec["errors"] = errors
    return rec


def serve_run(server: Server, args: argparse.Namespace, engine: str) -> dict:
    from nanoserve.bench.serve import run, summarize
    model = server.model()
    ns = argparse.Namespace(base_url=server.url, api_key=None, model=model,
                            endpoint="completions", max_concurrency=None, seed=args.seed,
                            temperature=0.0, ignore_eos=True, request_rate=args.serve_rate)
    jobs = serve_jobs(args)
    results, duration = asyncio.run(asyncio.wait_for(run(ns, jobs), args.part_timeout))
    for result in results:  # a server that reports no usage: one streamed chunk per token
        if result.ok and not result.output_tokens:
            result.output_tokens = len(result.itl) + 1
    s = summarize(results, duration)
    keep = ("completed", "failed", "duration_s", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "mean_e2el_ms",
            "errors")
    return record(engine, "serve", request_rate=args.serve_rate, num_prompts=len(jobs),
                  input_len=args.serve_input_len, output_len=args.serve_output_len,
                  **{k: s[k] for k in keep if k in s})


def record(engine: str, workload: str, **fields) -> dict:
    return {"bench": "peers", "engine": engine, "workload": workload, **fields}


# ---- llama.cpp -------------------------------------------------------------------------------

def llama_parts(args: argparse.Namespace, bindir: Path, gguf: Path) -> list[dict]:
    recs: list[dict] = []
    gpu = ["-ngl", "999"] if args.device != "cpu" else []
    fa = ["-fa", "on"]
    if "decode" in args.workloads:
        cmd = [str(bindir / "llama-bench"), "-m", str(gguf), *gpu, *fa, "-p", "0",
               "-n", str(args.new_tokens), "-d", ",".join(map(str, args.contexts)),
               "-r", str(args.repeats), "-o", "jsonl"]
        code, out = run_logged("llama-bench", cmd, args.part_timeout)
        for line in out.splitlines():
            if line.startswith("{") and '"avg_ts"' in line:
                r = json.loads(line)
                recs.append(record("llama.cpp", f"decode-{r['n_depth']}", context=r["n_depth"],
                                   new_tokens=r["n_gen"],
                                   ms_per_token=round(1000.0 / r["avg_ts"], 4),
                                   tok_s=round(r["avg_ts"], 2),
                                   each_run_tok_s=[round(x, 2) for x in r.get("samples_ts", [])],
                                   build=r.get("build_commit"), backends=r.get("backends"),
                                   gpu_info=r.get("gpu_info"), flash_attn=r.get("flash_attn"),
                                   type_k=r.get("type_k")))
        if code != 0:
            recs.append(record("llama.cpp", "decode", error=f"llama-bench exit {code}: "
                               + " | ".join(out.strip().splitlines()[-2:])[-300:]))
    if "uniform" in args.workloads:
        pp, tg, pl = args.uniform_pp, args.uniform_tg, args.uniform_pl
        cmd = [str(bindir / "llama-batched-bench"), "-m", str(gguf), *gpu, *fa,
               "-c", str(pl * (pp + tg) + 64), "-b", "2048", "-ub", "512", "-npp", str(pp),
               "-ntg", str(tg), "-npl", str(pl), "--output-format", "jsonl"]
        code, out = run_logged("llama-batched-bench", cmd, args.part_timeout)
        found = False
        for line in out.splitlines():
            if line.startswith("{") and '"speed_tg"' in line:
                r = json.loads(line)
                found = True
                recs.append(record("llama.cpp", "uniform", pp=pp, tg=tg, pl=pl,
                                   seconds=round(r["t"], 3),
                                   output_tok_s=round(pl * tg / r["t"], 1),
                                   decode_tok_s=round(r["speed_tg"], 1),
                                   prefill_tok_s=round(r["speed_pp"], 1)))
        if not found:
            recs.append(record("llama.cpp", "uniform", error=f"llama-batched-bench exit {code}: "
                               + " | ".join(out.strip().splitlines()[-2:])[-300:]))
    if {"throughput", "serve"} & set(args.workloads):
        slots = max(args.num_seqs, 1)
        per_slot = max(args.max_input_len + args.max_output_len,
                       args.serve_input_len + args.serve_output_len) + 16
        port = free_port()
        cmd = [str(bindir / "llama-server"), "-m", str(gguf), *gpu, *fa, "--host", "127.0.0.1",
               "--port", str(port), "-np", str(slots), "-c", str(slots * per_slot),
               "--no-webui", "-cram", "0"]
        recs += server_parts(args, "llama.cpp", cmd, port)
    return recs


def server_parts(args: argparse.Namespace, engine: str, cmd: list[str], port: int,
                 env: dict | None = None) -> list[dict]:
    recs: list[dict] = []
    name = "llama-server" if engine == "llama.cpp" else "nanoserve-serve"
    try:
        with Server(name, cmd, port, Path(args.work), env) as server:
            started = time.perf_counter()
            server.wait_ready(args.start_timeout)
            ready_s = round(time.perf_counter() - started, 1)
            for part, fn in (("throughput", http_throughput), ("serve", serve_run)):
                if part not in args.workloads:
                    continue
                try:
                    recs.append({**fn(server, args, engine), "server_ready_s": ready_s})
                except Exception as exc:  # noqa: BLE001 (one part's failure leaves the rest)
                    recs.append(record(engine, part, error=repr(exc)[:300]))
                log(f"{engine} {part}: {json.dumps(recs[-1])[:300]}")
    except Exception as exc:  # noqa: BLE001
        recs.append(record(engine, "server", error=repr(exc)[:300]))
    return recs


# ---- nanoserve -------------------------------------------------------------------------------

def nano_parts(args: argparse.Namespace, gguf: Path) -> list[dict]:
    recs: list[dict] = []
    offline = [w for w in ("decode", "uniform", "throughput") if w in args.workloads]
    if offline:
        result = Path(args.work) / "nano-offline.jsonl"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-offline", str(gguf),
               "--child-out", str(result), *sys.argv[1:]]
        code, _ = run_logged("nanoserve-offline", cmd, args.part_timeout * len(offline) + 60,
                             env=child_env())
        if result.is_file():
            recs += [json.loads(line) for line in result.read_text().splitlines() if line]
        if code != 0:
            recs.append(record("nanoserve", "offline",
                               error=f"exit {code if code is not None else 'timeout'}"))
    if {"throughput", "serve"} & set(args.workloads):
        port = free_port()
        longest = max(args.max_input_len + args.max_output_len,
                      args.serve_input_len + args.serve_output_len) + 16
        cmd = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve", str(gguf),
               "--port", str(port), "--dtype", args.dtype, "--max-num-seqs",
               str(max(args.num_seqs, args.serve_prompts)), "--max-model-len", str(longest),
               "--no-ui", "--log-level", "warning"]
        if args.device == "cpu":
            cmd += ["--device", "cpu"]
        recs += server_parts(args, "nanoserve", cmd, port, child_env())
    return recs


def child_offline(args: argparse.Namespace) -> None:
    """In a child process: nanoserve's LLM on the GGUF, the offline parts, records to a file."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.bench.common import timed_generate
    from nanoserve.bench.latency import time_decode
    out = Path(args.child_out)
    device = "cpu" if args.device == "cpu" else "auto"

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    longest = max(args.max_input_len + args.max_output_len, max(args.contexts) + args.new_tokens,
                  args.uniform_pp + args.uniform_tg) + 16
    t0 = time.perf_counter()
    llm = LLM(args.child_offline, dtype=args.dtype, device=device,
              max_num_seqs=max(args.num_seqs, args.uniform_pl), max_model_len=longest,
              enable_prefix_caching=False)
    load_s = round(time.perf_counter() - t0, 1)
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        if "decode" in args.workloads:
            for context in args.contexts:
                timing = time_decode(llm, decode_prompt(context), args.new_tokens,
                                     args.repeats, device)
                ms = timing.ms_per_token
                emit(record("nanoserve", f"decode-{context}", context=context,
                            new_tokens=args.new_tokens, ms_per_token=round(ms, 4),
                            tok_s=round(1000.0 / ms, 2) if ms > 0 else None,
                            each_run_ms_per_token=[round(t, 4) for t in timing.each_run_ms],
                            load_seconds=load_s))

        def timed(workload: str, prompts: list[list[int]], max_tokens: list[int], **fields):
            params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
                      for n in max_tokens]
            seconds, produced = timed_generate(llm, prompts, params, device)
            emit(record("nanoserve", workload, **fields, output_tokens=produced,
                        seconds=round(seconds, 3), output_tok_s=round(produced / seconds, 1),
                        load_seconds=load_s))

        if "uniform" in args.workloads:
            prompts = uniform_workload(args)
            timed("uniform", prompts, [args.uniform_tg] * len(prompts), pp=args.uniform_pp,
                  tg=args.uniform_tg, pl=args.uniform_pl)
        if "throughput" in args.workloads:
            prompts, max_tokens = throughput_workload(args)
            timed("throughput-offline", prompts, max_tokens, num_seqs=args.num_seqs,
                  max_input_len=args.max_input_len, max_output_len=args.max_output_len)
    finally:
        llm.close()


# ---- report ----------------------------------------------------------------------------------

ROWS = [  # (label, nanoserve workload, llama.cpp workload, metric, unit, lower is better)
    ("throughput, HTTP (both servers)", "throughput-http", "throughput-http", "output_tok_s",
     "output tok/s", False),
    ("throughput, nanoserve LLM.generate vs llama-server", "throughput-offline",
     "throughput-http", "output_tok_s", "output tok/s", False),
    ("uniform {pl} x ({pp} + {tg}), LLM.generate vs llama-batched-bench", "uniform", "uniform",
     "output_tok_s", "output tok/s", False),
    ("decode batch 1, context {c0}", "decode-{c0}", "decode-{c0}", "ms_per_token", "ms/token",
     True),
    ("decode batch 1, context {c1}", "decode-{c1}", "decode-{c1}", "ms_per_token", "ms/token",
     True),
    ("serve {rate} req/s: TTFT p50", "serve", "serve", "median_ttft_ms", "ms", True),
    ("serve: TTFT p99", "serve", "serve", "p99_ttft_ms", "ms", True),
    ("serve: ITL p50", "serve", "serve", "median_itl_ms", "ms", True),
    ("serve: ITL p99", "serve", "serve", "p99_itl_ms", "ms", True),
    ("serve: output tok/s", "serve", "serve", "output_throughput", "tok/s", False),
]


def table(records: list[dict], args: argparse.Namespace) -> str:
    """Per shape: workload x engine, the ratio nanoserve / llama.cpp (the unit says which way
    is better), the failed parts listed below."""
    lines = []
    contexts = (args.contexts + args.contexts)[:2]
    fmt = {"c0": contexts[0], "c1": contexts[1], "rate": f"{args.serve_rate:g}",
           "pp": args.uniform_pp, "tg": args.uniform_tg, "pl": args.uniform_pl}
    for shape in dict.fromkeys(r["shape"] for r in records):
        by = {(r["engine"], r["workload"]): r for r in records if r["shape"] == shape}
        lines += [f"### {shape}", "",
                  "| workload | unit | nanoserve | llama.cpp | nanoserve / llama.cpp |",
                  "|---|---|---:|---:|---:|"]
        for label, nw, lw, metric, unit, lower in ROWS:
            label, nw, lw = label.format(**fmt), nw.format(**fmt), lw.format(**fmt)
            n = by.get(("nanoserve", nw), {}).get(metric)
            ll = by.get(("llama.cpp", lw), {}).get(metric)
            ratio = f"{n / ll:.2f}" if isinstance(n, (int, float)) and ll else ""
            better = "lower" if lower else "higher"
            lines.append(f"| {label} | {unit} ({better} is better) | {_num(n)} | {_num(ll)} | "
                         f"{ratio} |")
        notes = [f"- {e} {w}: {r.get('error') or r.get('skipped')}" for (e, w), r in by.items()
                 if "error" in r or "skipped" in r]
        lines += [""] + notes + [""]
    return "\n".join(lines)


def _num(x) -> str:
    return "" if x is None else f"{x:,.2f}" if isinstance(x, float) and x < 100 else \
        f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)


def environment(llama_dir: Path | None) -> dict:
    """The benchmarks' environment fields (device, driver, versions, date) and llama.cpp's."""
    from nanoserve.bench.common import environment as bench_environment

    env: dict = bench_environment()
    if llama_dir and (llama_dir / "VERSION").is_file():
        env["llama_cpp"] = (llama_dir / "VERSION").read_text().splitlines()[0]
    elif llama_dir:
        code = subprocess.run([str(llama_dir / "llama-server"), "--version"], capture_output=True,
                              text=True, check=False)
        env["llama_cpp"] = (code.stdout + code.stderr).strip().splitlines()[-1:]
    return env


# ---- main ------------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", default=None,
                   help="Qwen3 shape (repeatable; default qwen3-0.6b, tiny-qwen3 with --dry-run)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--engines", nargs="+", default=["llama.cpp", "nanoserve"])
    p.add_argument("--workloads", nargs="+", default=["throughput", "uniform", "decode", "serve"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu"])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU check: --device cpu, tiny-qwen3, tiny workloads; llama.cpp only "
                        "with --llama-bin (a CPU build)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--work", default="/tmp/peers", help="GGUF, unpacked llama.cpp, site, logs")
    p.add_argument("--wheels", default=str(CACHE / "wheels"))
    p.add_argument("--llama-tar", default=str(CACHE / "llama-cpp-cuda.tar.xz"))
    p.add_argument("--llama-bin", default=None, help="a folder of llama.cpp binaries instead")
    p.add_argument("--tokenizer", default=str(ROOT / ".cache" / "qwen3-tokenizer"))
    p.add_argument("--rewrite-gguf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("workloads")
    g.add_argument("--num-seqs", type=int, default=128, help="throughput requests [128]")
    g.add_argument("--max-input-len", type=int, default=1024)
    g.add_argument("--max-output-len", type=int, default=512)
    g.add_argument("--uniform-pp", type=int, default=512)
    g.add_argument("--uniform-tg", type=int, default=128)
    g.add_argument("--uniform-pl", type=int, default=64)
    g.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--serve-prompts", type=int, default=96)
    g.add_argument("--serve-rate", type=float, default=16.0)
    g.add_argument("--serve-input-len", type=int, default=256)
    g.add_argument("--serve-output-len", type=int, default=128)
    g = p.add_argument_group("time boxes")
    g.add_argument("--part-timeout", type=float, default=120.0, help="seconds per part [120]")
    g.add_argument("--start-timeout", type=float, default=240.0, help="server start [240]")
    g.add_argument("--deadline-s", type=float, default=None,
                   help="start no engine after this many seconds")
    p.add_argument("--child-offline", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
        args.shape = args.shape or ["tiny-qwen3"]
        small = {"num_seqs": 4, "max_input_len": 120, "max_output_len": 110, "uniform_pp": 32,
                 "uniform_tg": 8, "uniform_pl": 2, "contexts": [16, 64], "new_tokens": 8,
                 "repeats": 1, "serve_prompts": 4, "serve_rate": 4.0, "serve_input_len": 32,
                 "serve_output_len": 8, "part_timeout": 300.0}
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in small.items():
            if key not in given:
                setattr(args, key, value)
    args.shape = args.shape or ["qwen3-0.6b"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child_offline:
        child_offline(args)
        return
    out = Path(os.environ.get("OUT") or "/tmp/peers-out")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    try:
        install_wheels(Path(args.wheels), work / "site")
        sys.path.insert(0, str(ROOT / "src"))
        llama_dir = unpack_llama(args) if "llama.cpp" in args.engines else None
        if llama_dir is None and args.dry_run and "llama.cpp" in args.engines:
            log("dry run without --llama-bin: llama.cpp skipped")
        env = environment(llama_dir)
        log(f"environment: {json.dumps(env)}")
        tok = tokenizer_dir(args)
        for shape in args.shape:
            t = time.perf_counter()
            gguf = write_gguf(args, shape, tok)
            log(f"{shape}: GGUF {gguf} ({gguf.stat().st_size / 2**30:.2f} GiB) in "
                f"{time.perf_counter() - t:.1f} s")
            for engine in args.engines:
                if args.deadline_s and time.perf_counter() - T0 > args.deadline_s:
                    records.append({**record(engine, "all", skipped="deadline"), "shape": shape})
                    continue
                t = time.perf_counter()
                if engine == "llama.cpp":
                    if llama_dir is None:
                        recs = [record(engine, "all", skipped="no llama.cpp binaries")]
                    else:
                        recs = llama_parts(args, llama_dir, gguf)
                else:
                    recs = nano_parts(args, gguf)
                log(f"{shape} {engine}: {len(recs)} records in {time.perf_counter() - t:.1f} s")
                for rec in recs:
                    rec = {**rec, "shape": shape, "layers": args.layers, **env}
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
                _write(out, records, args)
    finally:
        _write(out, records, args)
        if records:
            print(table(records, args), flush=True)
        log(f"done: {out}/peers.jsonl, peers.md, peers.log")
        (out / "peers.log").write_text("\n".join(LOG) + "\n")


def _write(out: Path, records: list[dict], args: argparse.Namespace) -> None:
    (out / "peers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if records:
        (out / "peers.md").write_text(table(records, args) + "\n")
    (out / "peers.log").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
