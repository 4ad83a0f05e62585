"""Bad input is refused with a clear error, and the engine keeps serving afterwards."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig

GOOD_PROMPT = "The capital of France is"
GOOD_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MAX_MODEL_LEN = 96


# ---- SamplingParams ---------------------------------------------------------------------------

BAD_SAMPLING = [
    ("temperature", -0.1), ("temperature", "abc"), ("temperature", math.nan),
    ("temperature", None), ("temperature", True),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1), ("top_p", "abc"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", "abc"), ("top_k", None),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", "abc"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", "abc"),
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", "abc"),
    ("frequency_penalty", 2.1), ("frequency_penalty", -2.1), ("frequency_penalty", math.inf),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5), ("seed", "abc"), ("seed", True),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5), ("max_tokens", "abc"),
    ("min_tokens", -1), ("min_tokens", "abc"), ("min_tokens", 2.0),
    ("stop", 5), ("stop", [1]), ("stop", [""]), ("stop", ""), ("stop", ["a", None]),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop_token_ids", "abc"),
    ("stop_token_ids", 5), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]),
    ("logprobs", -1), ("logprobs", "abc"), ("logprobs", 2.0),  # the engine caps them
    ("prompt_logprobs", -1), ("prompt_logprobs", 1.0),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
    ("truncate_prompt_tokens", 1.5),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: 200.0}), ("logit_bias", {1: "x"}),
    ("logit_bias", "x"),
    ("include_stop_str_in_output", "yes"), ("ignore_eos", 1), ("skip_special_tokens", None),
    # Not finite: JSON's 1e309 parses as inf; an int can pass any float.
    ("temperature", math.inf), ("temperature", 10**400), ("top_p", math.nan),
    ("min_p", math.nan), ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("logit_bias", {1: math.nan}), ("logit_bias", {1: math.inf}),
]


@pytest.mark.parametrize("field,value", BAD_SAMPLING,
                         ids=[f"{f}={v!r:.30}" for f, v in BAD_SAMPLING])
def test_bad_sampling_param_names_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(5\), got 6"):
        SamplingParams(max_tokens=5, min_tokens=6)
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


GOOD_SAMPLING = [
    ("temperature", 0), ("temperature", 0.0), ("temperature", 3.5),
    ("top_p", 1), ("top_p", 1e-6), ("top_k", -1), ("top_k", 0), ("top_k", 1),
    ("min_p", 0), ("min_p", 1.0), ("repetition_penalty", 1e-3), ("repetition_penalty", 5),
    ("presence_penalty", -2), ("presence_penalty", 2.0), ("frequency_penalty", -2.0),
    ("seed", 0), ("seed", 2**63 - 1), ("max_tokens", None), ("max_tokens", 1),
    ("stop", "x"), ("stop", ["a", "bc"]), ("stop", ("a",)), ("stop", []),
    ("stop_token_ids", (3, 4)), ("stop_token_ids", []), ("logprobs", 0), ("logprobs", 20),
]


@pytest.mark.parametrize("field,value", GOOD_SAMPLING,
                         ids=[f"{f}={v!r}" for f, v in GOOD_SAMPLING])
def test_boundary_sampling_params_are_accepted(field, value):
    params = SamplingParams(**{field: value})
    assert isinstance(params.stop_strings, list) and isinstance(params.stop_token_ids, list)


# ---- EngineConfig -----------------------------------------------------------------------------

BAD_ENGINE = [
    ("max_num_seqs", 0), ("max_num_seqs", "8"), ("max_num_seqs", True), ("max_num_seqs", 2.0),
    ("max_num_batched_tokens", -1), ("max_num_batched_tokens", None),
    ("block_size", 0), ("block_size", 12), ("block_size", 16.0),
    ("tensor_parallel_size", 0), ("max_model_len", 0), ("max_model_len", "x"),
    ("num_kv_blocks", 0), ("num_kv_blocks", -3), ("kv_cache_memory", -1),
    ("max_waiting_requests", 0), ("max_waiting_requests", "5"),
    ("dtype", "float8"), ("dtype", "fp16"), ("dtype", None), ("load_format", "pt"),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", "abc"), ("gpu_memory_utilization", math.nan),
    ("gpu_memory_utilization", None),
    ("device", "tpu"), ("device", "cuda:x"), ("device", ""), ("device", None),
    ("seed", "x"), ("seed", -1), ("seed", 1.5),
    ("enable_prefix_caching", "yes"), ("enforce_eager", 1),
    ("model", 123), ("max_n", 0), ("max_n", 2.0), ("max_logprobs", -1), ("max_logprobs", None),
]


@pytest.mark.parametrize("field,value", BAD_ENGINE, ids=[f"{f}={v!r}" for f, v in BAD_ENGINE])
def test_bad_engine_config_names_its_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        EngineConfig(**{field: value})


def test_good_engine_configs_are_accepted(tmp_path):
    for kw in ({}, {"device": "cpu"}, {"device": "cuda"}, {"device": "cuda:1"},
               {"block_size": 1}, {"max_model_len": None}, {"gpu_memory_utilization": 1},
               {"seed": 0}, {"model": str(tmp_path)}, {"model": tmp_path},
               {"enable_prefix_caching": False, "enforce_eager": True},
               {"max_n": 1, "max_logprobs": 0}):
        EngineConfig(**kw)


# ---- model loading ----------------------------------------------------------------------------

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        LLM(str(missing), device="cpu")


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", '{"model_type": "nonsense"}'])
def test_corrupt_config_json(tiny_llama, tmp_path, content):
    path = _copy(tiny_llama, tmp_path / "m")
    (path / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(path), device="cpu")


def test_unsupported_rope_type(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        config.pop(key, None)
    config["rope_scaling"] = {"rope_type": "proportional", "factor": 2.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope type 'proportional' is not supported; supported: "):
        LLM(str(path), device="cpu")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                       n_positions=32))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        LLM(str(tmp_path), device="cpu")
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


def test_folder_without_safetensors(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "m")
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(path), device="cpu")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad_header"])
def test_corrupt_safetensors(tiny_llama, tmp_path, damage):
    path = _copy(tiny_llama, tmp_path / "m")
    [weights] = list(path.glob("*.safetensors"))
    data = weights.read_bytes()
    if damage == "garbage":
        weights.write_bytes(b"\x00\x01not a safetensors file" * 10)
    elif damage == "truncated":
        weights.write_bytes(data[:len(data) // 2])
    else:  # a header length pointing past the end of the file
        weights.write_bytes((10**9).to_bytes(8, "little") + data[8:200])
    with pytest.raises(ValueError, match=weights.name):
        LLM(str(path), device="cpu", dtype="float32")


# ---- bad requests to a live engine ------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def good_tokens(llm):
    [out] = llm.generate(GOOD_PROMPT, GOOD_PARAMS, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GOOD_PARAMS.max_tokens
    return out.outputs[0].token_ids


def _assert_still_serves(llm, good_tokens):
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks, "blocks leaked"
    outs = llm.generate([GOOD_PROMPT, "Hi"], GOOD_PARAMS, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == good_tokens
    assert len(outs[1].outputs[0].token_ids) == GOOD_PARAMS.max_tokens


def _vocab(llm):
    return llm.engine.model_config.vocab_size


BAD_REQUESTS = {
    "empty string": (lambda llm: [""], None, "must not be empty"),
    "empty ids": (lambda llm: [[]], None, "must not be empty"),
    "id = vocab size": (lambda llm: [[1, 2, _vocab(llm)]], None, r"must be in \[0, "),
    "negative id": (lambda llm: [[5, -1]], None, r"must be in \[0, "),
    "float id": (lambda llm: [[1, 2.0]], None, "string or a list of token ids"),
    "None prompt": (lambda llm: [None], None, "string or a list of token ids"),
    "dict prompt": (lambda llm: [{"prompt": "x"}], None, "string or a list of token ids"),
    "prompt over max_model_len": (lambda llm: ["word " * 200], None, "max_model_len"),
    "prompt + max_tokens over max_model_len": (
        lambda llm: [[7] * 80], SamplingParams(max_tokens=17), "80 prompt tokens and asks for 17 more"),
    "prompt of max_model_len, max_tokens None": (
        lambda llm: [[7] * MAX_MODEL_LEN], SamplingParams(max_tokens=None), "max_model_len"),
    "good then bad in one batch": (
        lambda llm: [GOOD_PROMPT, "Hi", [_vocab(llm) + 5]], None, r"must be in \[0, "),
    "params not a SamplingParams": (
        lambda llm: [GOOD_PROMPT, "Hi"], [GOOD_PARAMS, {"temperature": 0}], "SamplingParams"),
    "too few params": (lambda llm: [GOOD_PROMPT, "Hi"], [GOOD_PARAMS], "1 SamplingParams"),
    "allowed id past the vocabulary": (
        lambda llm: [GOOD_PROMPT], SamplingParams(allowed_token_ids=[3, 10**9]),
        r"allowed_token_ids token ids must be in \[0, "),
    "logit_bias id past the vocabulary": (
        lambda llm: [GOOD_PROMPT], SamplingParams(logit_bias={10**9: 1.0}),
        r"logit_bias token ids must be in \[0, "),
    "n past max_n": (lambda llm: [GOOD_PROMPT], SamplingParams(n=129),
                     r"^n must be <= 128 \(the engine's max_n\), got 129"),
    "logprobs past max_logprobs": (lambda llm: [GOOD_PROMPT], SamplingParams(logprobs=21),
                                   r"^logprobs must be <= 20 \(the engine's max_logprobs\)"),
    "prompt_logprobs past max_logprobs": (
        lambda llm: [GOOD_PROMPT], SamplingParams(prompt_logprobs=21),
        r"^prompt_logprobs must be <= 20 \(the engine's max_logprobs\)"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_engine_keeps_serving(llm, good_tokens, case):
    prompts, params, message = BAD_REQUESTS[case]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts(llm), params, use_tqdm=False)
    _assert_still_serves(llm, good_tokens)


def test_limits_on_samples_and_logprobs_are_engine_options(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=32, max_n=2,
              max_logprobs=30)
    [out] = llm.generate("Hi", SamplingParams(max_tokens=2, logprobs=25, n=2), use_tqdm=False)
    assert len(out.outputs) == 2
    # The top 25, and the sampled token when it is not among them.
    assert {len(lps) for c in out.outputs for lps in c.logprobs} <= {25, 26}
    with pytest.raises(ValueError, match=r"^n must be <= 2 \(the engine's max_n\), got 3"):
        llm.generate("Hi", SamplingParams(n=3), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^logprobs must be <= 30"):
        llm.generate("Hi", SamplingParams(logprobs=31), use_tqdm=False)


def test_longest_allowed_request_runs(llm, good_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [out] = llm.generate([[7] * (MAX_MODEL_LEN - 16)], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].finish_reason == "length"
    # with no max_tokens, generation stops at max_model_len
    [out] = llm.generate([[7] * 90], SamplingParams(max_tokens=None, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - 90
    assert out.outputs[0].finish_reason == "length"
    _assert_still_serves(llm, good_tokens)


def test_duplicate_request_id(llm, good_tokens):
    engine = llm.engine
    engine.add_request("dup", GOOD_PROMPT, GOOD_PARAMS)
    with pytest.raises(ValueError, match="'dup' is already in use"):
        engine.add_request("dup", "Hi", GOOD_PARAMS)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["dup"]
    assert finals[0].outputs[0].token_ids == good_tokens
    _assert_still_serves(llm, good_tokens)


def test_request_bigger_than_the_whole_kv_cache_is_refused(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=3, block_size=16)
    assert llm.engine.block_manager.num_blocks == 3
    prompt = [7] * 20
    with pytest.raises(ValueError, match=r"needs 4 KV cache blocks .* whole cache has 3"):
        llm.generate([prompt], SamplingParams(max_tokens=29), use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache blocks"):  # unbounded max_tokens never fits
        llm.generate([prompt], SamplingParams(max_tokens=None), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    # exactly the whole cache fits, alone and next to others (which then wait or get preempted)
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    [alone] = llm.generate([prompt], params, use_tqdm=False)
    assert len(alone.outputs[0].token_ids) == 28
    outs = llm.generate([prompt, [8] * 20, prompt], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [28, 28, 28]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_checkpoint_missing_one_part_of_a_packed_projection(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "missing-k"
    shutil.copytree(tiny_llama, folder)
    weights = next(folder.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(weights).items()
               if "layers.1.self_attn.k_proj" not in k and "layers.0.mlp.up_proj" not in k}
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"qkv_proj.weight \(k\)") as err:
        LLM(str(folder), device="cpu", num_kv_blocks=16)
    assert "gate_up_proj.weight (1)" in str(err.value)


def test_truncated_prompt_keeps_its_last_tokens(llm):
    long = list(range(5, 5 + MAX_MODEL_LEN + 40))  # too long for the context as it is
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                            truncate_prompt_tokens=50)
    [out] = llm.generate([long], params, use_tqdm=False)
    assert out.prompt_token_ids == long[-50:]
    [same] = llm.generate([long[-50:]], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    [text] = llm.generate(["word " * 120], params, use_tqdm=False)
    assert text.prompt is None and len(text.prompt_token_ids) == 50  # cut: no longer the text
    with pytest.raises(ValueError, match="max_model_len"):  # -1 keeps max_model_len tokens
        llm.generate([long], SamplingParams(truncate_prompt_tokens=-1), use_tqdm=False)
