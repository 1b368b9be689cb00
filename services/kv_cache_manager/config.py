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

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        if self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
