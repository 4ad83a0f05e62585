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
    assert "torch_dtype" not in proc.stderr  # transformers' deprecation warning, not ours
    assert "KV blocks of 16 tokens, max_model_len 512" in proc.stderr  # the start-up log


def test_chat_streams_a_reply_per_line_until_eof(smollm2_path):
    proc = _cli("chat", "--model", str(smollm2_path), "--temperature", "0", "--max-tokens", "12",
                *ENGINE, stdin="What is the capital of France?\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "torch_dtype" not in proc.stderr


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


def test_help_explains_every_engine_flag_with_its_default(capsys):
    import dataclasses

    import pytest

    from nanoserve.config import EngineConfig
    from nanoserve.entrypoints.cli import main

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        text = " ".join(help_text[help_text.index("\nengine:"):].split())  # unwrapped
        for f in dataclasses.fields(EngineConfig):
            flag = "--" + f.name.replace("_", "-")
            after = text.split(f"{flag} {f.name.upper()} ", 1)[1] if f.type != "bool" else \
                text.split(f"--no-{flag[2:]} ", 1)[1]
            described = after.split(" --", 1)[0]
            assert len(described) > 15, (flag, described)
            if f.default is not None:
                assert f"(default: {f.default})" in described, (flag, described)


def test_bad_sampling_flag_fails_before_the_model_loads(tmp_path, capsys):
    from nanoserve.entrypoints.cli import main

    # The model does not exist: had it been loaded first, the error would name the path.
    assert main(["generate", "--model", str(tmp_path / "nope"), "--top-p", "1.5"]) == 2
    assert "top_p must be" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "nope"), "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_default_served_model_name_is_short():
    from nanoserve.entrypoints.serve_command import served_name

    assert served_name(None) == "SmolLM2-135M-Instruct"
    assert served_name("models/my-model") == "models/my-model"  # as given, as vLLM's


def test_chat_output_carries_the_rendered_prompt(tiny_llama):
    from transformers import AutoTokenizer

    from nanoserve import LLM, SamplingParams

    messages = [{"role": "user", "content": "Hi there"}]
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=16)
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    want = AutoTokenizer.from_pretrained(tiny_llama).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == want
    llm.close()
