"""The served model's tokenizer and chat template (Hugging Face ``tokenizer.json`` in the model folder)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.errors import FailedPrecondition, InvalidArgument


class Tokenizer:
    """Thin wrapper that turns tokenizer failures into clear errors.

    Args:
        model_dir: folder holding ``tokenizer.json`` / ``tokenizer_config.json``.
    """

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text to token ids."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Renders ``(role, content)`` messages with the generation prompt appended."""
        if not self.has_chat_template:
            raise FailedPrecondition("chat: the served model has no chat template; send text or token_ids")
        for role, _ in messages:
            if role not in ("system", "user", "assistant"):
                raise InvalidArgument(f"chat.messages.role: must be system, user or assistant, got {role!r}")
        rendered = self.hf.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )
        if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
            rendered = rendered["input_ids"]
        return [int(t) for t in rendered]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text."""
        text: str = self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text
