"""The `nanoserve` command as a user runs it: generate and chat in a subprocess."""
from __future__ import annotations

import subprocess
import sys

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


def test_bad_flag_value_is_a_clear_error(tiny_llama):
    proc = _cli("generate", "--model", str(tiny_llama), "--top-p", "1.5", *ENGINE)
    assert proc.returncode == 2
    assert "top_p must be" in proc.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    proc = _cli("generate", "--model", str(tmp_path / "nope"), *ENGINE)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr
