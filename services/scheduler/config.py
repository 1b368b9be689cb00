"""The scheduler's frozen configuration (read from ``KVMESH_SCHED_*`` in main.py only)."""

from __future__ import annotations

from dataclasses import dataclass

# The public API's port: the one owner of "where a scheduler listens unless told" (the CLI, the
# suite, the gateway and the client default to it).
DEFAULT_PORT = 50051
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORT}"
ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True)
class SchedulerConfig:
    """Step-loop limits, admission control and where the other services are.

    Attributes:
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_waiting_requests: bound of the waiting queue; beyond it ``RESOURCE_EXHAUSTED``.
        max_waiting_tokens: bound of prompt tokens waiting; beyond it ``RESOURCE_EXHAUSTED``.
        max_logprobs: most top logprobs a request may ask for.
        enable_prefix_caching: reuse cached prefix blocks (per request salts still apply).
        preemption_mode: ``recompute`` (free and recompute later) or ``swap`` (via offload-store).
        model_dir: folder with the tokenizer (and chat template) of the served model.
        kvm_address / runner_address / offload_address: ``host:port`` of the other services;
            an empty offload address disables the offload tier.
        rpc_timeout_seconds: deadline of each internal RPC.
        deployment_key: secret root of the prefix-hash chain; the scheduler derives the seed from
            it and the model id and sends it to the kv-cache-manager in ``Initialize`` (its one
            owner: no other service reads the key).
        owner_lease_seconds: how long the kv-cache-manager and the offload-store keep this
            scheduler as their owner without a call (renewed every step and by a keep-alive);
            a successor of a scheduler that died without releasing waits at most this long.
        trace_steps: how many of a request's first steps get their own span (then every
            ``trace_step_every``-th), so a 2,000-token answer is not 2,000 spans.
        trace_step_every: sampling period of step spans after the first ``trace_steps``.
        min_priority: the lowest (most urgent) priority a request may ask for, unless the keys
            file gives its tenant another floor (``INVALID_ARGUMENT`` below it).
        max_bytes_per_token: bound on the UTF-8 bytes one token can stand for; a text or chat
            prompt longer than ``max_model_len`` times this can never fit, so it is refused
            before the tokenizer runs (docs/lifecycle.md).
        max_request_id_bytes / max_cache_salt_bytes / max_stop_string_bytes: byte bounds of
            those string fields; ``max_stop_strings``: how many stop strings a request may send.
        max_chat_messages: most messages in a chat prompt.
        max_concurrent_tokenizations: tokenizer runs (encode / chat template) at once; a request
            that cannot start one within ``tokenize_wait_seconds`` gets ``RESOURCE_EXHAUSTED``.
        dependency_check_seconds: how often readiness probes the runner, kv-cache-manager and
            offload-store (each probe has this as its timeout too).
        role: the replica's part in prefill/decode disaggregation (docs/mesh.md, "Prefill/decode"):
            ``mixed`` (both phases, the default), ``prefill`` (publishes every request's full prompt
            blocks to the offload-store as soon as its first token is sampled, so a decode replica
            can load them from the shared remote tier) or ``decode`` (behaves as ``mixed``; the
            name only documents the deployment). The router's replica list says the same for routing.
        async_scheduling: send the next step while one runs when it needs no allocation
            (lookahead.py; docs/design.md, "Async scheduling"), as vLLM's ``--async-scheduling``;
            answers are those of synchronous steps. Off only for A/B runs and tests.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1_000_000
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    model_dir: str = ""
    kvm_address: str = "127.0.0.1:50052"
    runner_address: str = "127.0.0.1:50053"
    offload_address: str = ""
    rpc_timeout_seconds: float = 60.0
    deployment_key: str = "kvmesh-dev"
    owner_lease_seconds: float = 10.0
    trace_steps: int = 4
    trace_step_every: int = 64
    min_priority: int = 0
    max_bytes_per_token: int = 32
    max_request_id_bytes: int = 256
    max_cache_salt_bytes: int = 256
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_chat_messages: int = 1024
    max_concurrent_tokenizations: int = 4
    tokenize_wait_seconds: float = 2.0
    dependency_check_seconds: float = 1.0
    role: str = "mixed"
    async_scheduling: bool = True

    @property
    def sends_ahead(self) -> bool:
        """Whether steps are sent ahead (async scheduling) and so allocations reserve slots for them.

        NOTE: not on a prefill replica: its requests end at their first token, so there is no next
        step to send, and its prompts are published to the offload-store as each step returns.
        """
        return self.async_scheduling and self.role != "prefill"

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not self.owner_lease_seconds > 0:
            raise ValueError("owner_lease_seconds must be positive")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.role not in ROLES:
            raise ValueError(f"KVMESH_SCHED_ROLE must be one of {ROLES}, got {self.role!r}")
        if self.max_bytes_per_token <= 0 or self.max_concurrent_tokenizations <= 0:
            raise ValueError("max_bytes_per_token and max_concurrent_tokenizations must be positive")
