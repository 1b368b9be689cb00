"""Turns an engine's per-request outputs into client chunks: detokenized text, stop strings, final info.

Shared by the gRPC servicer and the in-process client, so both stream exactly the same chunks.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from services.scheduler.detokenizer import IncrementalDetokenizer
from services.scheduler.engine import Engine
from services.scheduler.request import FinishReason, RequestSpec
from services.scheduler.tokenizer import Tokenizer
from services.scheduler.types import Chunk, Final
from services.scheduler.validation import validate_request
from shared.sampling_params import SamplingParams


def build_spec(
    engine: Engine,
    prompt_token_ids: Sequence[int],
    sampling: SamplingParams,
    max_tokens: int,
    stop: Sequence[str] = (),
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    deadline: float | None = None,
    trace_context: Any = None,
) -> RequestSpec:
    """Validates a request (raising ``InvalidArgument`` naming the field) and builds its spec."""
    validate_request(prompt_token_ids, sampling, max_tokens, engine.info, engine.config)
    return RequestSpec(
        request_id=request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(prompt_token_ids),
        sampling=sampling,
        max_tokens=max_tokens,
        stop=tuple(stop),
        priority=priority,
        cache_salt=cache_salt.encode(),
        deadline=deadline,
        trace_context=trace_context,
    )


class OutputStream:
    """Iterates chunks of one request; :meth:`cancel` aborts it (safe to call any time)."""

    def __init__(self, engine: Engine, spec: RequestSpec, tokenizer: Tokenizer | None,
                 include_special_tokens: bool = False) -> None:
        self.engine = engine
        self.spec = spec
        self._queue = engine.add_request(spec)
        self._detok = (
            IncrementalDetokenizer(tokenizer.hf, spec.prompt_token_ids, spec.stop, not include_special_tokens)
            if tokenizer is not None else None
        )
        self._done = False

    @property
    def request_id(self) -> str:
        """The request id."""
        return self.spec.request_id

    def cancel(self) -> None:
        """Aborts the request unless it already ended."""
        if not self._done:
            self.engine.abort(self.spec.request_id)

    def __iter__(self) -> Iterator[Chunk]:
        n_out = 0
        while not self._done:
            out = self._queue.get()
            if out.error is not None:
                self._done = True
                raise out.error
            n_out += len(out.token_ids)
            tokens, logprobs = out.token_ids, out.logprobs
            text = self._detok.add(tokens, final=out.finished) if self._detok else ""
            stop = self._detok.stop_hit if self._detok is not None else None
            if stop is not None and not out.finished:
                # A stop string ended the output: stop the engine and wait for its final record
                # (tokens produced meanwhile are dropped).
                self.engine.abort(self.spec.request_id, FinishReason.STOP, stop)
                while not out.finished:
                    out = self._queue.get()
            final = None
            if out.finished:
                self._done = True
                reason = FinishReason.STOP if stop is not None else (out.finish_reason or FinishReason.ABORT)
                metrics = out.metrics
                if metrics is not None and stop is not None:
                    metrics = dataclasses.replace(metrics, completion_tokens=n_out)
                final = Final(reason, stop if stop is not None else out.stop_reason, metrics)
                if out.error is not None and stop is None:
                    raise out.error
            if tokens or text or final is not None:
                yield Chunk(self.request_id, tokens, text, logprobs, final)
