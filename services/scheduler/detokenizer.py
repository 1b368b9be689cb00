"""Incremental detokenization with stop strings.

Text is streamed as tokens arrive, but never a partial UTF-8 character (a byte-level token can
end mid-character: the decoder then yields U+FFFD, and we wait for the next token) and never the
beginning of a stop string that may still complete (up to ``len(longest stop) - 1`` characters are
held back until they are known not to start one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into new text, applying stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=)``).
        prompt_token_ids: the prompt, whose last tokens give context to the first output token.
        stop: stop strings; output ends before the first occurrence (not included).
        skip_special_tokens: drop special tokens (e.g. EOS) from the text.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all output text so far (truncated at a stop string)
        self._sent = 0
        self.stop_hit: str | None = None

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=self._skip,
                                     clean_up_tokenization_spaces=False)
        return text

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Appends tokens; returns the text that may be streamed now.

        Args:
            token_ids: new output tokens.
            final: the request ended: flush everything held back (except a stop string).
        """
        if self.stop_hit is None and (token_ids or final):
            self._ids.extend(token_ids)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            # A trailing U+FFFD is an incomplete character: wait for its next bytes, unless no
            # more tokens will come (then the text is what decoding all ids gives).
            if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
                before = len(self.text)
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
                self._check_stop(before)
        limit = len(self.text) if (final or self.stop_hit is not None) else len(self.text) - self._hold
        if limit <= self._sent:
            return ""
        out = self.text[self._sent : limit]
        self._sent = limit
        return out

    def _check_stop(self, before: int) -> None:
        hits = [(idx, stop) for stop in self._stop
                if (idx := self.text.find(stop, max(0, before - len(stop) + 1))) != -1]
        if hits:
            idx, stop = min(hits)
            self.text = self.text[:idx]
            self.stop_hit = stop
