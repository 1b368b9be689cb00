"""The served model's tokenizer and chat template (Hugging Face ``tokenizer.json`` in the model folder)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


class TokenizeGate:
    """Bounds how many tokenizations run at once, so a burst of prompts cannot take every core
    (and, through the GIL, the engine's step loop) or grow memory without bound.

    Args:
        limit: tokenizations at once.
        wait: seconds a request may wait for a slot before ``RESOURCE_EXHAUSTED``.
    """

    def __init__(self, limit: int, wait: float) -> None:
        self.limit = limit
        self.wait = wait
        self._slots = threading.BoundedSemaphore(limit)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Holds one slot for the block's duration."""
        if not self._slots.acquire(timeout=self.wait):
            raise ResourceExhausted(f"tokenizer busy ({self.limit} tokenizations running); retry later")
        try:
            yield
        finally:
            self._slots.release()


class Tokenizer:
    """Thin wrapper that turns tokenizer failures into clear errors.

    Args:
        model_dir: folder holding ``tokenizer.json`` / ``tokenizer_config.json``.
    """

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir)
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))
        self._lock = threading.Lock()
        self.runs = 0  # encodes and chat renderings started: how tests see that a limit came first

    def _count(self) -> None:
        with self._lock:
            self.runs += 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text to token ids."""
        self._count()
        ids: list[int] = self.hf.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Renders ``(role, content)`` messages with the generation prompt appended."""
        if not self.has_chat_template:
            raise FailedPrecondition("chat: the served model has no chat template; send text or token_ids")
        for role, _ in messages:
            if role not in ("system", "user", "assistant"):
                raise InvalidArgument(f"chat.messages.role: must be system, user or assistant, got {role!r}")
        self._count()
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
