"""Sampling parameters as a frozen dataclass: what the scheduler validates and the runner obeys."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. The defaults are greedy decoding with no penalties.

    ``top_k <= 0`` and ``top_p == 1`` disable those filters; penalties of 0 (additive) or 1
    (repetition) disable those.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # top-n alternatives to report; None = no logprobs
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        """Argmax decoding (temperature 0)."""
        return self.temperature == 0.0

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Raises :class:`InvalidArgument` naming the first bad field."""
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in floats.items():
            if math.isnan(value) or math.isinf(value):
                raise InvalidArgument(f"sampling.{name} must be a finite number, got {value}")
        if self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise InvalidArgument(f"sampling.top_k must be >= -1, got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise InvalidArgument(
                f"sampling.repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"sampling.seed must be a 64-bit unsigned integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise InvalidArgument(f"sampling.logprobs must be in [0, {max_logprobs}], got {self.logprobs}")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise InvalidArgument(f"stop_token_ids: {tok} is outside the vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class TokenLogprob:
    """A token and its log-probability (the runner samples it, the scheduler streams it)."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledLogprobs:
    """The sampled token's logprob and the top-n alternatives."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...]
