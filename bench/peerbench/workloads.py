"""The workloads of issue 17, as seeded random token-id prompts shared by every engine.

Every engine gets the same token ids (no chat template, no text round trip, so every prompt has
exactly its length), decodes greedily and produces exactly ``output_len`` new tokens with EOS
ignored. Each repeat of a workload draws its own prompts: every engine here caches prefixes (vLLM's
prefix caching is on by default, kvmesh's too), and a repeat of the same prompts would measure a
cache hit instead of a prefill. The warm-up prompts are drawn from yet another seed.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.serve.datasets import LengthDist, TokenSpace, random_dataset


@dataclass(frozen=True)
class Workload:
    """``num_prompts`` prompts of ``input_len`` tokens, ``output_len`` new tokens each, all at once.

    ``metric`` says which figure the table shows: ``tok/s`` (output tokens per wall second) for
    decode-bound workloads, ``wall s`` for prefill-bound ones (where output tok/s means little).
    """

    name: str
    num_prompts: int
    input_len: int
    output_len: int
    metric: str = "tok/s"

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise ValueError(f"workload {self.name}: counts and lengths must be >= 1")
        if self.metric not in ("tok/s", "wall s"):
            raise ValueError(f"workload {self.name}: metric must be 'tok/s' or 'wall s', got {self.metric!r}")

    @property
    def title(self) -> str:
        """``32 x (128 in + 128 out)``."""
        return f"{self.num_prompts} x ({self.input_len:,} in + {self.output_len:,} out)"

    @property
    def output_tokens(self) -> int:
        """New tokens of one run of the workload."""
        return self.num_prompts * self.output_len


# The table, in its order: batch decode, single stream, prefill-bound.
FULL = (
    Workload("batch32", 32, 128, 128),
    Workload("single", 1, 128, 128),
    Workload("prefill8x1024", 8, 1024, 16, metric="wall s"),
)
# ``--quick``: the same three shapes, small enough for a smoke run of every engine.
QUICK = (
    Workload("batch32", 8, 32, 16),
    Workload("single", 1, 32, 16),
    Workload("prefill8x1024", 2, 256, 4, metric="wall s"),
)
WARMUP_PROMPTS = 2
WARMUP_OUTPUT_LEN = 4


@dataclass(frozen=True)
class WorkloadPrompts:
    """The prompts of one workload: an untimed warm-up set and one set per repeat."""

    workload: Workload
    warmup: tuple[tuple[int, ...], ...]
    repeats: tuple[tuple[tuple[int, ...], ...], ...]


def select(names: str, quick: bool) -> tuple[Workload, ...]:
    """The workloads named in a comma list (``all`` = every one), full-size or ``--quick``."""
    pool = QUICK if quick else FULL
    if names in ("", "all"):
        return pool
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = {w.name: w for w in pool}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return tuple(known[n] for n in wanted)


def _prompts(count: int, length: int, space: TokenSpace, seed: int) -> tuple[tuple[int, ...], ...]:
    convs = random_dataset(count, LengthDist(length), LengthDist(1), space, seed)
    return tuple(c.turns[0].user_token_ids for c in convs)


def build_prompts(workload: Workload, vocab_size: int, repeats: int, seed: int, index: int) -> WorkloadPrompts:
    """Seeded prompts: repeat ``r`` of the workload at position ``index`` uses seed ``seed + 1000 * index + r``.

    The warm-up set (``WARMUP_PROMPTS`` prompts of the workload's input length) uses
    ``seed + 1000 * index + 999``, so it shares no prefix with a measured prompt.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    space = TokenSpace.for_vocab(vocab_size)
    base = seed + 1000 * index
    warm = _prompts(min(WARMUP_PROMPTS, workload.num_prompts), workload.input_len, space, base + 999)
    sets = tuple(_prompts(workload.num_prompts, workload.input_len, space, base + r) for r in range(repeats))
    return WorkloadPrompts(workload, warm, sets)
