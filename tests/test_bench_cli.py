"""`nanoserve bench`: throughput on the CPU with a tiny model prints one JSON line and draws a
real PNG; latency profiles its steps on request; serve against a running server (the
in-process fake engine) plots too."""
from __future__ import annotations

import json
import subprocess
import sys

from test_server import fake, serve_in_thread  # noqa: F401 (fake is a fixture)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_png(path, min_bytes: int = 10_000) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > min_bytes
    height, width, _ = matplotlib.image.imread(path).shape  # decodes: a valid image
    assert width >= 600 and height >= 200


def test_bench_throughput_prints_one_json_line_and_plots(tmp_path):
    out = tmp_path / "throughput.png"
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "bench", "throughput",
         "--device", "cpu", "--shapes", "tiny-qwen3", "--num-prompts", "3",
         "--max-input-len", "110", "--max-output-len", "104", "--plot", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    record = json.loads(lines[0])
    assert record["bench"] == "throughput" and record["num_seqs"] == 3
    assert record["output_tok_s"] > 0 and record["floor_tok_s"] > 0
    _check_png(out)


def test_bench_latency_profiles_each_step_on_request(tmp_path):
    """``--profile-kernels``: each context's record says how many launches and how much time a
    decode step takes, and stderr lists them by kernel (on the CPU: by op)."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "bench", "latency",
         "--device", "cpu", "--shapes", "tiny-qwen3", "--contexts", "16", "--new-tokens", "8",
         "--repeats", "1", "--profile-kernels"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.splitlines()[-1])
    assert record["bench"] == "latency" and record["context"] == 16
    assert record["launches_per_step"] > 10 and record["kernel_us_per_step"] > 0
    assert "calls/step" in proc.stderr and "aten::" in proc.stderr


def test_bench_latency_sizes_the_cache_for_every_cache_group(tmp_path):
    """A model with six cache groups (five sliding layers, one full) at a context past its
    window: the benchmark's one-sequence cache holds a block a group per position."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "bench", "latency",
         "--device", "cpu", "--shapes", "tiny-gemma3", "--contexts", "2048", "--new-tokens",
         "4", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.splitlines()[-1])
    assert record["context"] == 2048 and record["ttft_ms"] > 0


def test_bench_serve_against_a_server_plots_its_latencies(fake, tmp_path, capsys):  # noqa: F811
    from nanoserve.bench.serve import main
    from nanoserve.entrypoints.server import build_app

    _, async_engine = fake
    out = tmp_path / "serve.png"
    with serve_in_thread(build_app(async_engine, "fake")) as url:
        main(["--base-url", url, "--num-prompts", "12", "--random-input-len", "4",
              "--random-output-len", "6", "--request-rate", "50", "--plot", str(out)])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12 * 6 and summary["median_itl_ms"] > 0
    _check_png(out, min_bytes=20_000)


def test_serve_resends_a_request_the_server_dropped_unanswered():
    """A server that closes the first connection as the request arrives (a kept-alive one it
    had dropped) gets the request again; one that never answers is reported failed."""
    import asyncio

    import httpx

    from nanoserve.bench.serve import send

    chunk = json.dumps({"choices": [{"text": "hi"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
    body = f"data: {chunk}\n\ndata: [DONE]\n\n".encode()

    async def scenario(drops: int) -> tuple[object, int]:
        seen = 0

        async def handle(reader, writer):
            nonlocal seen
            seen += 1
            await reader.readuntil(b"\r\n\r\n")
            if seen <= drops:
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient(timeout=10) as client:
            result = await send(client, f"http://127.0.0.1:{port}/v1/completions",
                                {"prompt": "x"}, chat=False)
        return result, seen

    result, seen = asyncio.run(scenario(drops=1))
    assert result.ok and result.output_tokens == 1 and seen == 2
    result, seen = asyncio.run(scenario(drops=5))
    assert not result.ok and "RemoteProtocolError" in result.error and seen == 2
