"""Tensor parallelism on the CPU when things go wrong: a worker killed under a serving engine,
and an engine started from a script that multiprocessing could not re-run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server import _descendants, start_server


def _workers(pid: int) -> list[int]:
    """The server's spawned tensor-parallel workers (not multiprocessing's resource tracker)."""
    return [child for child in _descendants(pid)
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("num_streams", [3, 0])  # killed mid-step, or while idle
def test_a_killed_worker_fails_every_stream_and_the_server_exits_nonzero(
        tiny_llama, tmp_path, num_streams):
    srv = start_server(tiny_llama, tmp_path / "log", "--tensor-parallel-size", "2")
    children = _descendants(srv.proc.pid)
    workers = _workers(srv.proc.pid)
    assert len(workers) == 1
    ends: dict[int, tuple[float, list[str]]] = {}
    streaming = threading.Barrier(num_streams + 1)

    def stream(i: int) -> None:
        body = {"prompt": f"Stream {i}", "max_tokens": 480, "ignore_eos": True, "stream": True}
        lines = []
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        if len(lines) == 1:
                            streaming.wait(60)
        finally:
            ends[i] = (time.monotonic(), lines)

    readers = [threading.Thread(target=stream, args=(i,)) for i in range(num_streams)]
    try:
        for reader in readers:
            reader.start()
        streaming.wait(60)
        killed = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        for reader in readers:
            reader.join(30)
        assert len(ends) == num_streams
        while time.monotonic() - killed < 10:  # soon the server is unhealthy, then gone
            try:
                if httpx.get(srv.url + "/health", timeout=5).status_code == 503:
                    break
            except httpx.TransportError:
                break
            assert not ends, "a stream ended while /health still said 200"
            time.sleep(0.05)
        else:
            raise AssertionError("/health still answers 200 10 s after the worker died")
        code = srv.proc.wait(30)
        exited = time.monotonic()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    for end, lines in ends.values():
        assert end - killed < 10
        assert lines[-1] == "data: [DONE]"
        assert "tensor-parallel worker" in json.loads(lines[-2][len("data: "):])["error"]["message"]
    assert code not in (0, None), srv.log_tail()
    assert exited - killed < 30
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in children)  # no orphan


STDIN_SCRIPT = """
import sys
from nanoserve import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids))
llm.close()
"""


def test_a_tensor_parallel_engine_starts_from_a_script_on_stdin(tiny_llama):
    # multiprocessing's workers would re-run the parent's __main__, here "<stdin>".
    run = subprocess.run([sys.executable, "-", str(tiny_llama)], input=STDIN_SCRIPT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "tokens 3"
