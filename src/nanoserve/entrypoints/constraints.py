"""What a request's output must match, from whichever field asked: OpenAI's ``response_format``
and forced ``tool_choice``, vLLM's ``structured_outputs`` and older ``guided_*`` fields."""
from __future__ import annotations

from typing import Any

from nanoserve.entrypoints.errors import APIError
from nanoserve.sampling_params import StructuredOutputsParams

# vLLM's older fields, each one kind of constraint.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def requested_constraint(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field that set it (None: unconstrained); a 400 naming
    the field when it is malformed or when two fields constrain the same answer."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    fields: list[tuple[str, Any]] = []
    if req.response_format is not None:
        fields.append(("response_format", _response_format(req.response_format)))
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        fields.append(("structured_outputs", req.structured_outputs))
    for name, kind in GUIDED_FIELDS.items():
        if getattr(req, name) is not None:
            fields.append((name, {kind: getattr(req, name)}))
    forced = getattr(req, "forced_tool_schema", lambda: None)()
    if forced is not None:
        fields.append(("tool_choice", {"json": forced}))
    for name, spec in fields:
        if spec is None:
            continue
        try:
            found.append((StructuredOutputsParams(**spec), name))
        except TypeError as exc:  # an unknown key
            raise APIError(f"{name} has an unknown field: {exc}", param=name) from None
        except ValueError as exc:
            raise APIError(f"{name}: {exc}", param=name) from None
    if len(found) > 1:
        raise APIError(f"only one field may constrain the output, got {found[0][1]} and "
                       f"{found[1][1]}", param=found[1][1])
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return {"json": schema}
    raise APIError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="response_format")


def tool_choice_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """The JSON schema of a forced answer: the named function's arguments, or (``name`` None,
    tool_choice "required") a non-empty array of ``{"name", "parameters"}`` calls."""
    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object", "properties": {}}

    if name is not None:
        return parameters(next(t for t in tools if t["function"]["name"] == name))
    calls = [{"type": "object", "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": parameters(t)}} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
