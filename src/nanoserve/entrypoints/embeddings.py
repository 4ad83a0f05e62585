"""``POST /v1/embeddings`` for an embedding model (``--task embed``): every input is one
engine request, all added in one batch; their pooled states come back as OpenAI's list."""
from __future__ import annotations

import base64
import json
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from nanoserve.entrypoints.errors import APIError, parse_request
from nanoserve.entrypoints.openai_handlers import OpenAIServing, _collect, _unless_disconnected
from nanoserve.entrypoints.protocol import _Strict
from nanoserve.prompts import truncate_prompt
from nanoserve.sampling_params import SamplingParams


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens


async def create_embeddings(serving: OpenAIServing, body: Any, request: Request) -> Response:
    """The embeddings of every input, in order; bad input is a 400 naming the field."""
    req: EmbeddingRequest = parse_request(EmbeddingRequest, body)
    serving.check_model(req.model)
    pooler = serving.engine.pooler
    if pooler is None:
        raise APIError("this model generates text; serve an embedding model (nanoserve "
                       "serve MODEL --task embed) for /v1/embeddings", param="model")
    try:
        pooler.check_dimensions(req.dimensions)
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=req.truncate_prompt_tokens)
    except ValueError as exc:
        raise APIError(str(exc), param=str(exc).split(" ", 1)[0]) from None
    given = req.input if isinstance(req.input, list) else [req.input]
    if not given:
        raise APIError("input must not be empty", param="input")
    if all(isinstance(t, int) for t in given):
        given = [given]  # one input as token ids
    for i, item in enumerate(given):
        if not item:
            raise APIError(f"input[{i}] must not be empty", param=f"input[{i}]")
    tokenizer = serving.engine.tokenizer
    prompts = await serving._off_loop(lambda: [tokenizer.encode(p) if isinstance(p, str)
                                               else list(p) for p in given])
    limit = serving.engine.max_model_len
    for i, ids in enumerate(prompts):
        kept = len(truncate_prompt(ids, req.truncate_prompt_tokens, limit))
        if kept >= limit:  # an embedding's prefill must fit with room for its step
            name = "input" if len(prompts) == 1 else f"input[{i}]"
            raise APIError(f"{name} has {kept} tokens; this model's maximum context length "
                           f"is {limit} tokens (max_model_len), less one", param=name)
    rid = f"embd-{uuid.uuid4().hex}"
    try:
        streams = await serving.engine.add_requests(
            [(f"{rid}-{i}", ids, params) for i, ids in enumerate(prompts)])
    except ValueError as exc:  # the engine's messages begin with the field, "prompt" here
        field = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param="input" if field == "prompt" else None) from None
    finals = await _unless_disconnected(request, _collect(streams))
    if finals is None:
        return Response(status_code=499)
    data = []
    for i, final in enumerate(finals):
        vector = pooler.finish(final.embedding, req.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": _encoded(vector, req.encoding_format)})
    tokens = sum(len(f.prompt_token_ids) for f in finals)
    return Response(json.dumps({"object": "list", "data": data,
                                "model": serving.served_model_name,
                                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                    media_type="application/json")


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
