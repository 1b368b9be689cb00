"""The KV-size formula and the KV cache group partition (shared/kv_layout.py)."""

from __future__ import annotations

import pytest

from shared.kv_layout import KVGroup, gqa_kv_bytes_per_token, kv_groups, layers_per_group, mla_kv_bytes_per_token


def test_gqa_formula_matches_the_seminar_example() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads of 128, fp16 -> 128 KiB per token.
    assert gqa_kv_bytes_per_token(32, 8, 128, 2) == 131072


def test_mla_formula_counts_latent_and_rope_key_once_per_layer() -> None:
    # DeepSeek-V3: 61 layers, latent 512 + rope 64, bf16 -> 70,272 bytes per token.
    assert mla_kv_bytes_per_token(61, 512, 64, 2) == 70272


def test_all_full_attention_is_one_group_of_every_layer() -> None:
    assert kv_groups([None] * 4) == (KVGroup(None, (0, 1, 2, 3)),)


def test_all_window_layers_are_one_window_group() -> None:
    assert kv_groups([16, 16, 16]) == (KVGroup(16, (0, 1, 2)),)


def test_alternating_layers_make_two_groups_full_first() -> None:
    assert kv_groups([16, None, 16, None]) == (KVGroup(None, (1, 3)), KVGroup(16, (0, 2)))


def test_five_to_one_pattern_makes_single_layer_groups() -> None:
    groups = kv_groups([32, 32, 32, 32, 32, None])
    assert groups == (KVGroup(None, (5,)), *(KVGroup(32, (i,)) for i in range(5)))
    assert layers_per_group(groups) == 1


def test_uneven_counts_pad_the_last_group() -> None:
    groups = kv_groups([None, None, 8, 8, 8])
    assert groups == (KVGroup(None, (0, 1)), KVGroup(8, (2, 3)), KVGroup(8, (4,)))
    assert layers_per_group(groups) == 2


@pytest.mark.parametrize("windows", [[], [0], [None, -3]])
def test_bad_layouts_raise(windows: list[int | None]) -> None:
    with pytest.raises(ValueError):
        kv_groups(windows)
