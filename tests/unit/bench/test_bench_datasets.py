"""Synthetic workloads: seeded determinism, exact shapes, token ranges, shared prefixes, turns."""

from __future__ import annotations

import random
import statistics

import pytest

from bench.serve.datasets import (
    LengthDist,
    TokenSpace,
    WorkloadOptions,
    max_prompt_len,
    multi_turn_dataset,
    num_requests,
    prefix_dataset,
    random_dataset,
)

SPACE = TokenSpace.for_vocab(49152)


def test_token_space_skips_the_special_tokens_at_the_bottom() -> None:
    assert TokenSpace.for_vocab(49152) == TokenSpace(1000, 49152)
    assert TokenSpace.for_vocab(384) == TokenSpace(96, 384)
    ids = TokenSpace(10, 20).draw(random.Random(0), 500)
    assert min(ids) >= 10 and max(ids) < 20 and len(set(ids)) == 10
    with pytest.raises(ValueError):
        TokenSpace.for_vocab(4)


def test_random_dataset_is_deterministic_and_exact_length() -> None:
    a = random_dataset(8, LengthDist(128), LengthDist(64), SPACE, seed=7)
    b = random_dataset(8, LengthDist(128), LengthDist(64), SPACE, seed=7)
    c = random_dataset(8, LengthDist(128), LengthDist(64), SPACE, seed=8)
    assert a == b
    assert a != c
    assert [conv.conversation_id for conv in a] == list(range(8))
    for conv in a:
        (turn,) = conv.turns
        assert len(turn.user_token_ids) == 128
        assert turn.output_len == 64
        assert conv.cache_salt == ""
        assert all(SPACE.low <= t < SPACE.high for t in turn.user_token_ids)


def test_uniform_range_ratio_bounds_like_vllm() -> None:
    dist = LengthDist(100, "uniform", range_ratio=0.5)
    rng = random.Random(0)
    lengths = [dist.sample(rng) for _ in range(2000)]
    assert min(lengths) == 50
    assert max(lengths) == 150


def test_lognormal_has_the_mean_and_a_clipped_tail() -> None:
    dist = LengthDist(200, "lognormal", sigma=0.8)
    rng = random.Random(0)
    lengths = [dist.sample(rng) for _ in range(20000)]
    assert min(lengths) >= 1 and max(lengths) <= 800
    assert statistics.median(lengths) < statistics.mean(lengths)  # right-skewed, like ShareGPT
    assert statistics.mean(lengths) == pytest.approx(200, rel=0.05)


@pytest.mark.parametrize("bad", [dict(mean=0), dict(mean=5, kind="zipf"), dict(mean=5, range_ratio=1.0)])
def test_length_dist_rejects_bad_parameters(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LengthDist(**bad)  # type: ignore[arg-type]


def test_prefix_dataset_shares_each_prefix_round_robin() -> None:
    convs = prefix_dataset(
        6, prefix_len=32, num_prefixes=2, suffix_len=LengthDist(8), output_len=LengthDist(4), space=SPACE, seed=1
    )
    prompts = [c.turns[0].user_token_ids for c in convs]
    assert all(len(p) == 40 for p in prompts)
    assert prompts[0][:32] == prompts[2][:32] == prompts[4][:32]
    assert prompts[1][:32] == prompts[3][:32] == prompts[5][:32]
    assert prompts[0][:32] != prompts[1][:32]
    assert len({p[32:] for p in prompts}) == 6  # unique suffixes
    assert {c.cache_salt for c in convs} == {""}


def test_prefix_dataset_unique_salts_turn_sharing_off() -> None:
    convs = prefix_dataset(4, 16, 1, LengthDist(4), LengthDist(2), SPACE, seed=3, unique_salts=True)
    salts = [c.cache_salt for c in convs]
    assert len(set(salts)) == 4 and all(salts)


def test_multi_turn_conversations() -> None:
    convs = multi_turn_dataset(3, turns=4, user_len=LengthDist(10), output_len=LengthDist(5), space=SPACE, seed=2)
    assert num_requests(convs) == 12
    conv = convs[0]
    assert [len(t.user_token_ids) for t in conv.turns] == [10] * 4
    # the last prompt carries 4 user turns and the 3 earlier answers
    assert max_prompt_len(conv) == 4 * 10 + 3 * 5
    with pytest.raises(ValueError):
        multi_turn_dataset(1, 0, LengthDist(1), LengthDist(1), SPACE, 0)


def test_workload_options_build_each_dataset() -> None:
    random_ = WorkloadOptions("random", num_prompts=5, input_len=12, output_len=3).build(1000)
    assert len(random_) == 5 and len(random_[0].turns[0].user_token_ids) == 12
    prefix = WorkloadOptions("prefix", num_prompts=4, input_len=6, prefix_len=20, num_prefixes=2).build(1000)
    assert len(prefix[0].turns[0].user_token_ids) == 26
    multi = WorkloadOptions("multi-turn", num_prompts=2, turns=3).build(1000)
    assert num_requests(multi) == 6
    with pytest.raises(ValueError):
        WorkloadOptions("sharegpt")
