"""Chat conversations to prompt token ids, through the tokenizer's own chat template."""
from __future__ import annotations

from typing import Any


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``conversation`` rendered by the tokenizer's chat template, with ``tools``
    (OpenAI function definitions) and ``template_kwargs`` as template variables. Raises
    ValueError when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))
    # The rendered template already holds BOS and friends: add none twice.
    return tokenizer.encode(text, add_special_tokens=False)
