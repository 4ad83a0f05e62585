"""Tensor parallelism on the CPU (gloo): same greedy tokens as one rank, sharded loading, lifecycle.

Sharded matmuls sum in another order than the unsharded ones, so greedy outputs must be equal or,
at their first divergence, each side's token must be in the other's top-5 (a near tie).
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from tp_models import build_tp_model

from nanoserve import LLM, SamplingParams
from nanoserve.attention.torch_backend import TorchAttentionBackend
from nanoserve.config import ModelConfig
from nanoserve.layers.parallel_state import tensor_parallel_group
from nanoserve.models.loader import CheckpointTensor, iter_weights, load_model_assets
from nanoserve.models.registry import build_model
from nanoserve.runner.distributed import WorkerError
from nanoserve.runner.inputs import SequenceChunk, StepInput
from nanoserve.runner.step_channel import SharedMemoryStepChannel, pack_step, unpack_step

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far",
           "Q: What is 2+2?\nA:"]
CPU = dict(device="cpu", dtype="float32")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens,
                          logprobs=5)


def generate(path, prompts, max_tokens: int, **engine_args):
    llm = LLM(str(path), **CPU, **engine_args)
    try:
        return [o.outputs[0] for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]
    finally:
        llm.close()


def assert_same_greedy(want, got) -> None:
    """Token-equal, or at the first divergence each side's token is in the other's top-5."""
    for w, g in zip(want, got, strict=True):
        assert len(w.token_ids) == len(g.token_ids)
        diverge = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b),
                       None)
        if diverge is not None:
            top_w, top_g = w.logprobs[diverge], g.logprobs[diverge]
            assert g.token_ids[diverge] in top_w and w.token_ids[diverge] in top_g, (
                f"diverged at token {diverge}: {w.token_ids[diverge]} (top-5 {list(top_w)}) vs "
                f"{g.token_ids[diverge]} (top-5 {list(top_g)})")


def tp_workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("nanoserve-tp")]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3-moe"])
def tp_model(request, tmp_path_factory, tokenizer_dir):
    return build_tp_model(request.param, tmp_path_factory.mktemp(f"tp_{request.param}"),
                          tokenizer_dir)


@pytest.fixture(scope="module")
def tp1_outputs(tp_model):
    return generate(tp_model, PROMPTS, 24)


@pytest.mark.parametrize("size", [2, 4])
def test_greedy_outputs_match_one_rank(tp_model, tp1_outputs, size):
    # A small token budget splits prefills into chunks and mixes them with decodes.
    got = generate(tp_model, PROMPTS, 24, tensor_parallel_size=size,
                   max_num_batched_tokens=16 if size == 4 else 8192)
    assert_same_greedy(tp1_outputs, got)
    assert not tp_workers()


def test_smollm2_gguf_at_three_ranks(smollm2_path):
    """9 heads and 3 KV heads over 3 ranks, from a dequantized then sliced GGUF."""
    want = generate(smollm2_path, PROMPTS, 16)
    got = generate(smollm2_path, PROMPTS, 16, tensor_parallel_size=3)
    assert_same_greedy(want, got)


def _load_rank(path, rank: int, size: int, monkeypatch) -> tuple[dict, int]:
    """One rank's parameters, loaded in this process (loading needs no communication), and
    how many checkpoint elements the rank read."""
    hf_config, _, _ = load_model_assets(path)
    with tensor_parallel_group(rank, size), torch.device("cpu"):
        model = build_model(ModelConfig.from_hf(hf_config), TorchAttentionBackend())
    read = []
    whole_read = CheckpointTensor.read

    def counting_read(self, narrow=None):
        out = whole_read(self, narrow)
        read.append(out.numel())
        return out

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointTensor, "read", counting_read)
        model.load_weights(iter_weights(path, torch.float32))
    return dict(model.named_parameters()), sum(read)


def reassemble(shards: list[dict], cfg: ModelConfig, size: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors rebuilt from every rank's parameters (the loader's inverse)."""
    q = cfg.num_heads * cfg.head_dim // size
    kv = max(1, cfg.num_kv_heads // size) * cfg.head_dim
    copies = max(1, size // cfg.num_kv_heads)  # consecutive ranks holding one replicated KV head
    inter = cfg.intermediate_size // size
    moe_inter = cfg.moe_intermediate_size // size
    out = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if "qkv_proj" in name:
            for rank, part in enumerate(parts):
                assert torch.equal(part[q:], parts[rank - rank % copies][q:])
            heads = parts[::copies]
            out[name.replace("qkv_proj", "q_proj")] = torch.cat([p[:q] for p in parts])
            out[name.replace("qkv_proj", "k_proj")] = torch.cat([p[q:q + kv] for p in heads])
            out[name.replace("qkv_proj", "v_proj")] = torch.cat([p[q + kv:] for p in heads])
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I/size, H]: one tensor per expert
            prefix = name.removesuffix("gate_up_proj")
            for e in range(parts[0].shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = torch.cat([p[e, :moe_inter] for p in parts])
                out[f"{prefix}{e}.up_proj.weight"] = torch.cat([p[e, moe_inter:] for p in parts])
        elif name.endswith("experts.down_proj"):  # [E, H, I/size]
            prefix = name.removesuffix("down_proj")
            for e in range(parts[0].shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = torch.cat([p[e] for p in parts], dim=1)
        elif "gate_up_proj" in name:
            out[name.replace("gate_up_proj", "gate_proj")] = torch.cat([p[:inter] for p in parts])
            out[name.replace("gate_up_proj", "up_proj")] = torch.cat([p[inter:] for p in parts])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.cat(parts, dim=1)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = torch.cat(parts)[:cfg.vocab_size]  # minus the vocab padding
        else:  # replicated: norms, Qwen3's per-head q/k norms, routers
            assert all(torch.equal(p, parts[0]) for p in parts), name
            out[name] = parts[0]
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_weights_reassemble_to_checkpoint(tp_model, size, monkeypatch):
    full = load_file(str(tp_model / "model.safetensors"))
    cfg = ModelConfig.from_hf(load_model_assets(tp_model)[0])
    ranks = [_load_rank(tp_model, r, size, monkeypatch) for r in range(size)]
    rebuilt = reassemble([params for params, _ in ranks], cfg, size)
    assert rebuilt.keys() == full.keys()
    assert all(torch.equal(rebuilt[name], full[name]) for name in full)
    # Each rank read about its share (embeddings dominate these models), not whole tensors.
    total = sum(t.numel() for t in full.values())
    assert all(read < 1.2 * total / size for _, read in ranks)


def test_size_one_layers_never_communicate(tp_model, tp1_outputs, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran at tensor_parallel_size=1")

    for name in ("all_reduce", "gather", "all_gather", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, forbidden)
    assert [o.token_ids for o in generate(tp_model, PROMPTS[:1], 24)] == \
        [tp1_outputs[0].token_ids]


def test_lm_head_writes_logits_in_place_on_one_rank():
    """Decode graphs keep one logits buffer for every batch size: the LM head fills it."""
    from nanoserve.layers.embedding import ParallelLMHead

    head = ParallelLMHead(50, 8)
    head.weight.data.normal_()
    hidden = torch.randn(3, 8)
    buffer = torch.empty(5, 50)
    assert head(hidden, out=buffer[:3]).data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[:3], head(hidden))
    with tensor_parallel_group(0, 2):
        sharded = ParallelLMHead(50, 8)
    with pytest.raises(AssertionError, match="tensor parallelism"):
        sharded(hidden, out=buffer[:3])


def test_step_packing_round_trips():
    chunks = [SequenceChunk("a", [5, 6, 7], 0, [3], True, None, [], [], [], 2),
              SequenceChunk("b", [9], 40, [1, 4, 8], False, None, [], [], []),
              SequenceChunk("c", [2, 2], 16, [], True, None, [], [], []),
              SequenceChunk("d", [2, 8, 9], 7, [5], True, None, [], [], [], 0, 2)]
    back = unpack_step(pack_step(StepInput(chunks, ["x"])).tolist()).chunks

    def fields(c):
        return (c.token_ids, c.start, c.block_table, c.sample, c.prompt_logprob_rows,
                c.num_draft_tokens)

    assert [fields(c) for c in back] == [fields(c) for c in chunks]
    # with three cache groups: each chunk carries a table per group, all as long
    for i, c in enumerate(chunks):
        c.more_tables = [[b + 100 * g for b in c.block_table] for g in (1, 2)]
    back = unpack_step(pack_step(StepInput(chunks)).tolist()).chunks
    assert [fields(c) + (c.more_tables,) for c in back] == \
        [fields(c) + (c.more_tables,) for c in chunks]


def test_prompt_logprobs_at_two_ranks(tiny_llama):
    """Workers run the LM head over the same prompt rows as rank 0, whose gather needs them."""
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, temperature=0.0)
    outs = []
    for size in (1, 2):
        llm = LLM(str(tiny_llama), **CPU, tensor_parallel_size=size, max_num_batched_tokens=8)
        try:
            outs.append(llm.generate(PROMPTS, params, use_tqdm=False))
        finally:
            llm.close()
    for one, two in zip(*outs, strict=True):
        prompt = one.prompt_token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            want, got = one.prompt_logprobs[pos], two.prompt_logprobs[pos]
            assert got[prompt[pos]] == pytest.approx(want[prompt[pos]], abs=1e-4)


def _echo_steps(channel: SharedMemoryStepChannel, rank: int, out) -> None:
    channel.rank = rank
    while (step := channel.recv()) is not None:
        out.send([(c.token_ids, c.start, c.block_table, c.sample) for c in step.chunks])
    out.send("closed")


def test_shared_memory_channel_delivers_every_step_to_every_worker():
    ctx = multiprocessing.get_context("spawn")
    abandoned = threading.Event()
    channel = SharedMemoryStepChannel(ctx, 2, capacity=64, abandoned=abandoned)
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_echo_steps, args=(channel, rank, w), daemon=True)
             for rank, (_, w) in enumerate(pipes, start=1)]
    for proc in procs:
        proc.start()
    steps = [[SequenceChunk("a", list(range(i, i + 3)), i, [i], bool(i % 2), None, [], [], [])]
             for i in range(20)]
    for chunks in steps:  # back to back: each waits only until every worker copied the last
        channel.send(StepInput(chunks))
    with pytest.raises(ValueError, match="exceeds"):
        channel.send(StepInput([SequenceChunk("b", [1] * 80, 0, [], True, None, [], [], [])]))
    channel.send(None)
    want = [[(c.token_ids, c.start, c.block_table, c.sample) for c in chunks] for chunks in steps]
    for r, _ in pipes:
        assert [r.recv() for _ in steps] == want and r.recv() == "closed"
    for proc in procs:
        proc.join(10)
    # A worker that no longer reads leaves rank 0 waiting only until the watchdog gives up.
    channel.send(StepInput(steps[0]))
    abandoned.set()
    with pytest.raises(RuntimeError, match="stopped reading"):
        channel.send(StepInput(steps[1]))


def test_worker_exception_surfaces_in_rank0(tiny_llama, tmp_path):
    # Half of down_proj's input columns: rank 0 finds its slice, rank 1's is past the end.
    for f in tiny_llama.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name][:, :weights[name].shape[1] // 2].contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WorkerError, match=r"(?s)rank 1.*down_proj"):
        LLM(str(tmp_path), **CPU, tensor_parallel_size=2)
    assert not tp_workers()
    assert not torch.distributed.is_initialized()


def test_dead_worker_fails_the_step_not_hangs(tiny_llama):
    llm = LLM(str(tiny_llama), **CPU, tensor_parallel_size=2)
    worker = llm.engine.executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    with pytest.raises(WorkerError, match="rank 1 exited with code -9"):
        llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    llm.close()
    assert not tp_workers() and not torch.distributed.is_initialized()


ENGINE_SCRIPT = """
import sys, time
from nanoserve import LLM
llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
print(*[p.pid for p in llm.engine.executor.workers], flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: exited, awaiting its reaper


def test_killed_engine_leaves_no_worker_and_engines_coexist(tiny_llama):
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(tiny_llama)],
                            stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and not any(_gone(p) for p in pids)
        # A second engine on this host, alive alongside: its own port, no shared names.
        got = generate(tiny_llama, PROMPTS[:2], 8, tensor_parallel_size=2)
        assert [len(o.token_ids) for o in got] == [8, 8]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(p) for p in pids)


TORCHRUN_SCRIPT = """
import json, sys
from nanoserve import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2)
# Only rank 0 gets here: rank 1 served inside LLM(...) until close, then exited.
params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=5)
outs = [o.outputs[0] for o in llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)]
print(json.dumps([[o.token_ids, [list(d.items()) for d in o.logprobs]] for o in outs]))
llm.close()
"""


def test_torchrun_env_init_runs_the_same_program(tiny_llama, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(script), str(tiny_llama), json.dumps(PROMPTS[:2])],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [SimpleNamespace(token_ids=ids, logprobs=[dict(d) for d in lps])
           for ids, lps in json.loads(run.stdout.strip().splitlines()[-1])]
    assert_same_greedy(generate(tiny_llama, PROMPTS[:2], 8), got)
