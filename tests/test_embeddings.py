"""Embeddings (``task="embed"``): LLM.embed and POST /v1/embeddings equal a plain
transformers forward with the same pooling on a tiny random Llama, fp32, to 1e-5; a
sentence-transformers folder is detected; bad input is a 400 naming the field."""
from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import openai
import pytest
import torch
from test_server import MODEL, metric_values, start_server

TEXTS = ["The capital of France is Paris, a city on the Seine with many bridges and a "
         "famous iron tower that was built for a world fair.", "Hello!",
         "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """transformers' final hidden states of each text, and its token ids."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    model = AutoModel.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer.encode(text)
            out[text] = (ids, model(torch.tensor([ids])).last_hidden_state[0].double())
    return out


def pooled(hidden: torch.Tensor, kind: str, normalize: bool = True, dims: int | None = None
           ) -> np.ndarray:
    vector = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[kind][:dims]
    return (vector / vector.norm() if normalize else vector).numpy()


@pytest.fixture(scope="module")
def st_folder(tiny_llama, tmp_path_factory):
    """The tiny Llama as a sentence-transformers model: mean pooling, then Normalize, with
    declared Matryoshka sizes."""
    folder = tmp_path_factory.mktemp("st") / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
         "pooling_mode_lasttoken": False}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    return folder


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_llm_embed_equals_transformers(tiny_llama, reference, kind):
    from nanoserve import LLM

    # A 16-token step budget prefills the long text in chunks: pooling spans steps.
    llm = LLM(str(tiny_llama), task="embed", pooling_type=kind, device="cpu",
              dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16)
    outs = llm.embed(TEXTS, use_tqdm=False)
    assert len(reference[TEXTS[0]][0]) > 16
    for text, out in zip(TEXTS, outs):
        ids, hidden = reference[text]
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.embedding, pooled(hidden, kind), atol=1e-5, rtol=0)
    assert llm.engine.block_manager.num_free_blocks == 32  # no KV kept
    with pytest.raises(ValueError, match="embeddings"):
        llm.generate("Hi")
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed("Hi", dimensions=8)  # no Matryoshka declared
    llm.close()


def test_sentence_transformers_folder_is_detected(st_folder, reference):
    from nanoserve import LLM

    llm = LLM(str(st_folder), device="cpu", dtype="float32", num_kv_blocks=32)
    assert llm.engine.config.task == "embed"
    out = llm.embed(TEXTS[0], dimensions=16, use_tqdm=False)[0]
    np.testing.assert_allclose(out.embedding, pooled(reference[TEXTS[0]][1], "mean", dims=16),
                               atol=1e-5, rtol=0)
    llm.close()


def test_generating_model_refuses_embed(tiny_llama):
    from nanoserve import LLM

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match="embedding model"):
        llm.embed("Hi")
    llm.close()


@pytest.fixture(scope="module")
def server(st_folder, tmp_path_factory):
    srv = start_server(st_folder, tmp_path_factory.mktemp("embed") / "log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


# Unset, the client asks for base64 and decodes it; asked for, it hands the text over.
@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_server_embeddings_equal_transformers(client, reference, encoding_format):
    fmt = {} if encoding_format is None else {"encoding_format": encoding_format}
    got = client.embeddings.create(model=MODEL, input=TEXTS, **fmt)
    assert [d.index for d in got.data] == [0, 1, 2]
    for text, item in zip(TEXTS, got.data):
        vector = item.embedding if encoding_format != "base64" else \
            np.frombuffer(base64.b64decode(item.embedding), "<f4")
        np.testing.assert_allclose(vector, pooled(reference[text][1], "mean"), atol=1e-5,
                                   rtol=0)
    assert got.usage.prompt_tokens == sum(len(reference[t][0]) for t in TEXTS)
    small = client.embeddings.create(model=MODEL, input=reference[TEXTS[1]][0], dimensions=32)
    np.testing.assert_allclose(small.data[0].embedding,
                               pooled(reference[TEXTS[1]][1], "mean", dims=32), atol=1e-5)


def test_server_frees_every_block(server, client):
    import httpx

    client.embeddings.create(model=MODEL, input=TEXTS)
    with httpx.Client(base_url=server.url) as http:
        values = metric_values(http)
    assert values["nanoserve:num_requests_running"] == 0
    assert values["nanoserve:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": 3.5}, "input"),
    ({"input": "word " * 600}, "input"),
    ({"input": [[1, 2, 10**9]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_a_400_naming_the_field(client, body, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/embeddings", body={"model": MODEL, **body}, cast_to=object)
    assert err.value.body["param"].startswith(field), err.value.body


def test_embedding_server_refuses_chat(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model"
