"""The `nanoserve` command as a user runs it: generate and chat in a subprocess."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", *args],
                          input=stdin, capture_output=True, text=True, timeout=300)


def test_generate_prints_each_prompt_and_its_completion(tiny_llama):
    from nanoserve import LLM, SamplingParams

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=64)
    want = llm.generate(["Hello there", "The sky is"],
                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    proc = _cli("generate", "--model", str(tiny_llama), "--prompt", "Hello there",
                "--prompt", "The sky is", "--temperature", "0", "--max-tokens", "6", *ENGINE)
    assert proc.returncode == 0, proc.stderr
    assert f"### Hello there\n{want[0].outputs[0].text}\n" in proc.stdout
    assert f"### The sky is\n{want[1].outputs[0].text}\n" in proc.stdout


def test_chat_streams_a_reply_per_line_until_eof(smollm2_path):
    proc = _cli("chat", "--model", str(smollm2_path), "--temperature", "0", "--max-tokens", "12",
                *ENGINE, stdin="What is the capital of France?\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_ctrl_c_while_a_reply_streams_exits_cleanly(tiny_llama):
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanoserve.entrypoints.cli", "chat", "--model", str(tiny_llama),
         "--max-tokens", "400", "--ignore-eos", *ENGINE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b"Tell me a long story.\n")
        proc.stdin.flush()  # left open: after a whole reply, chat would wait for more
        out, deadline = b"", time.time() + 120
        while len(out) < len(b"> ") + 20:  # the prompt, then the reply streaming in
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
            if select.select([proc.stdout], [], [], 1)[0]:
                out += os.read(proc.stdout.fileno(), 4096)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # 130 comes from the reply's interruption; a Ctrl-C at the prompt would end with 0.
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err, err.decode()
    assert not (out + rest).endswith(b"\n> ")  # cut mid-reply: no prompt after a whole one


def test_bad_flag_value_is_a_clear_error(tiny_llama):
    proc = _cli("generate", "--model", str(tiny_llama), "--top-p", "1.5", *ENGINE)
    assert proc.returncode == 2
    assert "top_p must be" in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    proc = _cli("generate", "--model", str(tmp_path / "nope"), *ENGINE)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
