"""Seeded synthetic workloads, generated locally as token ids.

Every workload is a list of :class:`Conversation`; a single request is a conversation of one turn,
so the driver has one code path. Prompts are token ids, not text, so each prompt has exactly the
length asked for (text would re-tokenize to a different length), and output lengths are enforced
with ``ignore_eos`` and ``max_tokens``.

Token ids are drawn uniformly from ``[low, vocab_size)`` (:class:`TokenSpace`): the low ids hold the
special tokens of most vocabularies (BOS/EOS, chat markers), which would change what the model does.

Lengths come from a :class:`LengthDist`:

- ``uniform``: vLLM's ``--random-range-ratio``: integers in ``[mean * (1 - r), mean * (1 + r)]``
  (``r = 0`` gives fixed lengths);
- ``lognormal``: a ShareGPT-like long tail with the given mean and shape ``sigma``, clipped to
  ``[1, 4 * mean]``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

DATASETS = ("random", "prefix", "multi-turn")


@dataclass(frozen=True)
class Turn:
    """One request of a conversation: the new user tokens and how many tokens to generate.

    The prompt actually sent is the conversation so far (earlier prompts and answers) followed by
    ``user_token_ids``; for a one-turn conversation it is ``user_token_ids`` itself.
    """

    user_token_ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after the other, each after the previous one finished."""

    conversation_id: int
    turns: tuple[Turn, ...]
    cache_salt: str = ""


@dataclass(frozen=True)
class TokenSpace:
    """The range token ids are drawn from: ``[low, high)``."""

    low: int
    high: int

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenSpace:
        """Skips the lowest quarter of the vocabulary (at most 1,000 ids), where special tokens live."""
        if vocab_size < 8:
            raise ValueError(f"vocab_size too small for a benchmark: {vocab_size}")
        return cls(low=min(1000, vocab_size // 4), high=vocab_size)

    def draw(self, rng: random.Random, n: int) -> tuple[int, ...]:
        """``n`` ids drawn uniformly."""
        return tuple(rng.randrange(self.low, self.high) for _ in range(n))


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integer lengths with the given mean (see the module docstring)."""

    mean: int
    kind: str = "uniform"
    range_ratio: float = 0.0
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if self.kind not in ("uniform", "lognormal"):
            raise ValueError(f"length distribution must be uniform or lognormal, got {self.kind!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range ratio must be in [0, 1), got {self.range_ratio}")

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.kind == "uniform":
            low = max(1, math.floor(self.mean * (1 - self.range_ratio)))
            high = max(low, math.ceil(self.mean * (1 + self.range_ratio)))
            return rng.randint(low, high)
        # NOTE: mu is chosen so the distribution's mean (exp(mu + sigma^2 / 2)) is ``mean``.
        mu = math.log(self.mean) - self.sigma**2 / 2
        return min(4 * self.mean, max(1, round(rng.lognormvariate(mu, self.sigma))))


def random_dataset(
    num_prompts: int, input_len: LengthDist, output_len: LengthDist, space: TokenSpace, seed: int
) -> list[Conversation]:
    """Independent prompts of random token ids."""
    rng = random.Random(seed)
    return [
        Conversation(i, (Turn(space.draw(rng, input_len.sample(rng)), output_len.sample(rng)),))
        for i in range(num_prompts)
    ]


def prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    num_prefixes: int,
    suffix_len: LengthDist,
    output_len: LengthDist,
    space: TokenSpace,
    seed: int,
    unique_salts: bool = False,
) -> list[Conversation]:
    """Prompts = one of ``num_prefixes`` shared "system prompts" of ``prefix_len`` tokens + a unique suffix.

    Prompt ``i`` uses prefix ``i % num_prefixes``. With ``unique_salts`` every prompt gets its own
    cache salt, so the server may not share cached blocks between them (prefix caching "off" for
    this workload, with everything else identical).
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefixes = [space.draw(rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        prompt = prefixes[i % num_prefixes] + space.draw(rng, suffix_len.sample(rng))
        salt = f"kvmesh-bench-{seed}-{i}" if unique_salts else ""
        out.append(Conversation(i, (Turn(prompt, output_len.sample(rng)),), cache_salt=salt))
    return out


def multi_turn_dataset(
    num_conversations: int, turns: int, user_len: LengthDist, output_len: LengthDist, space: TokenSpace, seed: int
) -> list[Conversation]:
    """Conversations of ``turns`` turns; each turn adds ``user_len`` new user tokens to the history."""
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    rng = random.Random(seed)
    return [
        Conversation(
            i, tuple(Turn(space.draw(rng, user_len.sample(rng)), output_len.sample(rng)) for _ in range(turns))
        )
        for i in range(num_conversations)
    ]


def num_requests(conversations: Sequence[Conversation]) -> int:
    """Requests the workload sends (one per turn)."""
    return sum(len(c.turns) for c in conversations)


def max_prompt_len(conversation: Conversation) -> int:
    """The longest prompt the conversation sends: its last turn's (every earlier turn and answer included)."""
    total = sum(len(t.user_token_ids) + t.output_len for t in conversation.turns)
    return total - conversation.turns[-1].output_len


@dataclass(frozen=True)
class WorkloadOptions:
    """The CLI's dataset options in one place (``kvmesh bench serve`` and ``bench compare`` share them).

    ``input_len`` is the whole prompt for ``random``, the unique suffix after the shared prefix for
    ``prefix``, and the new user tokens of each turn for ``multi-turn``.
    """

    dataset: str = "random"
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 64
    length_dist: str = "uniform"
    range_ratio: float = 0.0
    sigma: float = 0.5
    prefix_len: int = 256
    num_prefixes: int = 1
    turns: int = 3
    unique_salts: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")

    def build(self, vocab_size: int) -> list[Conversation]:
        """The workload: ``num_prompts`` prompts (conversations, for ``multi-turn``)."""
        space = TokenSpace.for_vocab(vocab_size)
        inp = LengthDist(self.input_len, self.length_dist, self.range_ratio, self.sigma)
        out = LengthDist(self.output_len, self.length_dist, self.range_ratio, self.sigma)
        if self.dataset == "random":
            return random_dataset(self.num_prompts, inp, out, space, self.seed)
        if self.dataset == "prefix":
            return prefix_dataset(
                self.num_prompts, self.prefix_len, self.num_prefixes, inp, out, space, self.seed, self.unique_salts
            )
        return multi_turn_dataset(self.num_prompts, self.turns, inp, out, space, self.seed)
