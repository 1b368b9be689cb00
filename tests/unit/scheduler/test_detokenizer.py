"""Incremental detokenization: multi-byte characters are never split, stop strings are held back."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.scheduler.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _stream(tok: object, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    d = IncrementalDetokenizer(tok, [5, 6], stop)
    pieces = [d.add([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return pieces, d


def test_multibyte_characters_never_split(tok: object) -> None:
    text = "naïve café 日本語 🙂 ok"
    pieces, _ = _stream(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # Byte-level BPE splits some characters over several tokens: some steps emit nothing.
    assert "" in pieces


def test_stop_string_truncates_and_is_held_back(tok: object) -> None:
    pieces, d = _stream(tok, "The capital of France is Paris. The end", stop=("Paris",))
    assert d.stop_hit == "Paris"
    assert "".join(pieces) == "The capital of France is "
    assert all("Par" not in p for p in pieces)


def test_earliest_of_several_stop_strings(tok: object) -> None:
    _, d = _stream(tok, "keys and values of past tokens", stop=("past", "and"))
    assert d.stop_hit == "and" and d.text == "keys "


def test_final_flush_matches_full_decode(tok: object) -> None:
    ids = tok.encode("日本", add_special_tokens=False)[:-1]  # type: ignore[attr-defined]
    d = IncrementalDetokenizer(tok, [5], ())
    out = "".join(d.add([t]) for t in ids) + d.add([], final=True)
    assert out == tok.decode(ids)  # type: ignore[attr-defined]
