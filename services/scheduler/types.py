"""The scheduler's public API as frozen dataclasses: what ``convert.py`` turns into protobuf and back.

One file for every shape that crosses the public boundary, so the servicer, the in-process
stream and the Python client speak the same types: a request (:class:`GenerateRequest`), the
chunks of its stream (:class:`Chunk`, the last one with :class:`Final` and its
:class:`RequestMetrics`), and what the suite serves (:class:`SchedulerModelInfo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.model_runner.types import SampledLogprobs
from services.scheduler.request import FinishReason
from shared.sampling_params import SamplingParams

# One chat turn: (role, content).
ChatMessage = tuple[str, str]


@dataclass(frozen=True)
class GenerateRequest:
    """A ``Generate`` call as sent: exactly one of ``text``, ``chat`` or ``token_ids`` is the prompt.

    Nothing here is validated: the server checks every field (``INVALID_ARGUMENT`` naming it), so
    a client cannot send anything the server would not refuse in the same way.
    """

    text: str | None = None
    chat: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)  # with stop ids and ignore_eos
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    request_id: str = ""
    priority: int = 0
    cache_salt: str = ""
    include_special_tokens: bool = False

    @property
    def prompt_kind(self) -> str | None:
        """``"text"``, ``"chat"``, ``"token_ids"``, or None when no prompt was given."""
        if self.text is not None:
            return "text"
        if self.chat is not None:
            return "chat"
        if self.token_ids is not None:
            return "token_ids"
        return None


@dataclass(frozen=True)
class RequestMetrics:
    """Final figures of one request (``GenerateFinal``'s counts and timing)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    queue_seconds: float
    ttft_seconds: float
    tpot_seconds: float
    e2e_seconds: float
    max_itl_seconds: float


@dataclass(frozen=True)
class Final:
    """The totals sent with a stream's last chunk."""

    finish_reason: FinishReason
    stop_reason: str
    metrics: RequestMetrics | None


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of output."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[SampledLogprobs | None, ...] = ()
    final: Final | None = None


@dataclass(frozen=True)
class SchedulerModelInfo:
    """What the suite serves: the runner's model and pool, the scheduler's limits and choices."""

    model_id: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    has_chat_template: bool
    dtype: str = ""
    attention_backend: str = ""
    dtype_reason: str = ""
    attention_backend_reason: str = ""
