"""The kv-cache-manager's configuration: the pool geometry it is bound to.

Not read from the environment: a bare kv-cache-manager knows nothing of its pool until the
scheduler's ``Initialize`` brings the runner's geometry (docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """Geometry of the paged KV cache.

    NOTE: no default for the pool size: the kv-cache-manager never serves a pool of its own
    invention; the scheduler sends the runner's geometry in ``Initialize``. There is no hash seed
    here: the scheduler owns it and sends block hashes, the kv-cache-manager never hashes.
    """

    num_blocks: int  # including the null block 0
    block_size: int = 16
    max_model_len: int = 2048
    model_id: str = ""  # a label for logs and metrics; the scheduler's hash seed covers the model
    # Per KV cache group its sliding window in tokens, None = full attention (the runner's
    # ``ModelInfo.kv_group_windows``, shared/kv_layout.py): one block table per group per request.
    group_windows: tuple[int | None, ...] = (None,)
    # Per KV cache group its attention-sink tokens (``ModelInfo.kv_group_sink_tokens``; StreamingLLM,
    # docs/kv_layout.md): a window group's first ``ceil(sinks / block_size)`` blocks are never freed.
    # Empty = no group has sinks.
    group_sink_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if not self.group_windows:
            raise ValueError("group_windows needs at least one group (None = full attention)")
        if any(w is not None and w < 1 for w in self.group_windows):
            raise ValueError(f"group_windows {self.group_windows}: a window must be >= 1 (None = full)")
        sinks = self.group_sink_tokens
        if sinks and len(sinks) != len(self.group_windows):
            raise ValueError(f"group_sink_tokens {sinks}: one entry per KV cache group ({len(self.group_windows)})")
        for sink, window in zip(sinks, self.group_windows, strict=False):
            if sink < 0 or (sink and window is None):
                raise ValueError(f"group_sink_tokens {sinks}: sink tokens must be >= 0, and only a window group "
                                 f"has them (windows {self.group_windows})")

    def sink_tokens(self, group: int) -> int:
        """Group ``group``'s attention-sink tokens (0 = none)."""
        return self.group_sink_tokens[group] if self.group_sink_tokens else 0

    @property
    def num_groups(self) -> int:
        """Block tables per request (KV cache groups)."""
        return len(self.group_windows)

    @property
    def has_windows(self) -> bool:
        """Whether some group slides a window (its dead blocks go back to the pool)."""
        return any(w is not None for w in self.group_windows)
