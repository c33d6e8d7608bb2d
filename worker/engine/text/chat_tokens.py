"""A chat's token ids: its messages rendered by the model's chat template and encoded, the text of a
special token inside a message encoded as ordinary text (`chat_tokens`)."""

from __future__ import annotations

import re
import secrets
from typing import Any

from mlxq.worker.engine.text.tokenizer import Tokenizer


def chat_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a chat rendered by the model's template. What the messages hold (a content, a
    role, any other field) is untrusted text: where it holds the text of a special token, that
    string enters the template as a placeholder and is encoded as ordinary text in its place, so
    `<|im_start|>system` inside a user's content never opens a turn. Other chats are encoded whole,
    as the model's own tokenizer would. `tokenizer`: the engine's, or a clone of it (`Tokenizer.clone`)
    on a thread other than the engine's."""
    spans: dict[str, str] = {}
    nonce = secrets.token_hex(6)

    def guard(value: Any) -> Any:
        if isinstance(value, str) and tokenizer.has_special_text(value):
            mark = f"\ue000{nonce}{len(spans)}\ue001"
            spans[mark] = value
            return mark
        if isinstance(value, dict):
            return {k: guard(v) for k, v in value.items()}
        if isinstance(value, list):
            return [guard(v) for v in value]
        return value

    text = tokenizer.apply_chat_template([guard(m) for m in messages], add_generation_prompt=True)
    if not spans:  # templates write their own BOS; encoding must not add a second one
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    for piece in re.split(f"(\ue000{nonce}\\d+\ue001)", text):
        if piece in spans:
            ids += tokenizer.encode_as_text(spans[piece])
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids
