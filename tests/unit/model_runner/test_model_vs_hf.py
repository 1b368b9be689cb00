"""Our model and runner against transformers on the same weights: logits, then greedy tokens.

The runner is driven by :class:`MiniScheduler` (conftest): requests arrive while others decode,
prefills are split into chunks, a request reuses the prompt blocks another one filled. Every
output must be token-identical to ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.model_runner.attention.base import AttentionMetadata
from services.model_runner.attention.torch_backend import TorchAttentionBackend
from services.model_runner.loader import load_model
from services.model_runner.model import head_screen
from services.model_runner.model.head_screen import (
    HeadScreen,
    HeadScreenInt8,
    screen_applies,
    screen_bf16_applies,
    screen_int8_applies,
)
from services.model_runner.model.transforms import prepare_model
from services.model_runner.native import load_kernels

ARCHS = ["llama", "qwen2", "mistral", "llama3"]


def _prompt(seed: int, length: int, vocab: int = 320) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


BACKENDS = ["torch", "cpu"]  # the reference, and decodes on the native paged kernel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", [*ARCHS, "llama_linear"])
def test_logits_match_transformers(
    name: str, backend: str, checkpoint: Any, hf_model: Any, make_runner: Any, all_logits: Any
) -> None:
    folder = checkpoint(name)
    tokens = _prompt(1, 37)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([tokens])).logits[0]  # [37, V]
    runner = make_runner(folder, backend=backend)
    assert runner.config.rope.rope_type == {"llama3": "llama3", "llama_linear": "linear"}.get(name, "default")
    one_pass = all_logits(runner, tokens)
    torch.testing.assert_close(one_pass, expected, atol=1e-4, rtol=0)
    chunked = all_logits(runner, tokens, chunks=[5, 1, 13, 18])  # chunks straddle block edges
    torch.testing.assert_close(chunked, expected, atol=1e-4, rtol=0)


def _check_against_generate(runner: Any, sched: Any, folder: Path, hf_model: Any, reference_greedy: Any) -> None:
    outputs = sched.run()
    model = hf_model(folder)
    for rid, req in sched.requests.items():
        assert outputs[rid] == reference_greedy(model, req.prompt, req.max_new_tokens), rid
    sched.flush()
    assert runner.request_ids == frozenset()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "chunk"), [("llama", 1 << 30), ("llama", 5), ("qwen2", 5), ("mistral", 3),
                                             ("llama3", 7)])  # fmt: skip
def test_greedy_matches_generate_with_arrivals_and_chunks(
    name: str, chunk: int, backend: str, checkpoint: Any, hf_model: Any, make_runner: Any, mini_scheduler: Any,
    sim_request: Any, reference_greedy: Any,
) -> None:  # fmt: skip
    folder = checkpoint(name)
    runner = make_runner(folder, num_blocks=96, backend=backend)
    sched = mini_scheduler(runner, chunk=chunk)
    sched.add(sim_request("a", _prompt(10, 11), max_new_tokens=12))
    sched.add(sim_request("b", _prompt(11, 7), max_new_tokens=8, arrival_step=4))  # A is decoding by then
    sched.add(sim_request("c", _prompt(12, 23), max_new_tokens=5, arrival_step=5))
    sched.add(sim_request("d", _prompt(13, 1), max_new_tokens=6, arrival_step=6))  # one-token prompt
    _check_against_generate(runner, sched, folder, hf_model, reference_greedy)
    steps = sched.steps
    assert any(s.new_requests and s.cached_requests for s in steps), "no step mixed new and running requests"
    if chunk < 23:
        c_chunks = [r.num_new_tokens for s in steps for r in (*s.new_requests, *s.cached_requests)
                    if r.request_id == "c"]  # fmt: skip
        assert c_chunks[: math.ceil(23 / chunk)] == [chunk] * (23 // chunk) + ([23 % chunk] if 23 % chunk else [])


@pytest.mark.parametrize("screen", ["int8", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])  # an untied head; a tied one, gathered from the embedding
def test_screened_fp32_head_matches_generate(
    name: str, screen: str, checkpoint: Any, hf_model: Any, make_runner: Any, mini_scheduler: Any,
    sim_request: Any, reference_greedy: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """fp32 mode on the native kernels screens greedy rows' columns where that pays
    (model/head_screen.py): in int8 groups where the CPU has AVX512-VNNI (its bf16 GEMM not on AMX),
    else in bf16 (here also with the int8 screen ruled out). The runner's head carries the screen,
    and the tokens are generate()'s. Off with ``screen_head=False``."""
    kernels = load_kernels()
    if screen == "int8" and not screen_int8_applies(kernels):
        pytest.skip("no AVX512-VNNI build here, or the bf16 GEMM runs on AMX (the bf16 screen is kept)")
    if screen == "bf16":
        if not screen_applies(kernels):
            pytest.skip("no AVX512-BF16 (vdpbf16ps or AMX) build of the native kernels here")
        monkeypatch.setattr(head_screen, "screen_int8_applies", lambda kernels: False)
    folder = checkpoint(name)
    runner = make_runner(folder, num_blocks=96, backend="cpu")
    head = runner.model.head_packing
    assert head is not None and head.mode == "native"
    assert isinstance(head.screen, HeadScreenInt8 if screen == "int8" else HeadScreen)
    assert (head.screen.dense is not None) == (name == "qwen2")
    screened: list[bool] = []  # each call's outcome: True where the screen gave the tokens itself
    monkeypatch.setattr(head.screen, "argmax", _spy(head.screen.argmax, screened))
    sched = mini_scheduler(runner, chunk=5)
    sched.add(sim_request("a", _prompt(10, 11), max_new_tokens=12))
    sched.add(sim_request("b", _prompt(11, 7), max_new_tokens=8, arrival_step=2))
    sched.add(sim_request("c", _prompt(12, 9), max_new_tokens=6, arrival_step=3))
    _check_against_generate(runner, sched, folder, hf_model, reference_greedy)
    assert len(screened) >= 12 and all(screened)  # every step sampled through it, none handed over
    model, _ = load_model(folder)
    prepare_model(model, "none", kernels=kernels, screen_head=False)
    other = model.head_packing
    assert other is not None and other.screen is None


def _spy(argmax: Callable[..., bool], calls: list[bool]) -> Callable[..., bool]:
    """``argmax`` itself, each outcome recorded (True: the screen gave the tokens)."""

    def spy(*args: Any) -> bool:
        calls.append(argmax(*args))
        return calls[-1]

    return spy


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_screened_bf16_head_keeps_the_tokens(
    name: str, checkpoint: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """bf16 mode's head screened in int8 groups (model/head_screen.py, where the CPU has
    AVX512-VNNI): the same tokens as the same runner's full bf16 head, every step's from the screen."""
    kernels = load_kernels()
    if not screen_bf16_applies(kernels):
        pytest.skip("no AVX512-VNNI beside the native bf16 GEMM here")
    folder = checkpoint(name)
    outputs = []
    for screened in (True, False):
        runner = make_runner(folder, num_blocks=96, backend="cpu", gemm_dtype="bfloat16")
        head = runner.model.head_packing
        assert head is not None and head.mode == "native_bf16" and isinstance(head.screen, HeadScreenInt8)
        calls: list[bool] = []
        if screened:
            monkeypatch.setattr(head.screen, "argmax", _spy(head.screen.argmax, calls))
        else:
            head.screen = None
        sched = mini_scheduler(runner, chunk=5)
        sched.add(sim_request("a", _prompt(10, 11), max_new_tokens=12))
        sched.add(sim_request("b", _prompt(11, 7), max_new_tokens=8, arrival_step=2))
        sched.add(sim_request("c", _prompt(12, 9), max_new_tokens=6, arrival_step=3))
        outputs.append(sched.run())
        assert not screened or (len(calls) >= 12 and all(calls))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_blocks_filled_by_another_request(
    backend: str, checkpoint: Any, hf_model: Any, make_runner: Any, mini_scheduler: Any, sim_request: Any,
    reference_greedy: Any,
) -> None:  # fmt: skip
    folder = checkpoint("llama")
    runner = make_runner(folder, num_blocks=96, backend=backend)
    sched = mini_scheduler(runner, chunk=6)
    shared = _prompt(20, 13)
    sched.add(sim_request("donor", shared + _prompt(21, 3), max_new_tokens=10))
    # Arrives while the donor decodes: 12 of its 15 tokens are in the donor's 3 full blocks.
    sched.add(sim_request("while", shared + _prompt(22, 2), max_new_tokens=6, arrival_step=5, prefix_from="donor"))
    # Arrives after the donor finished (its blocks stay cached): prompt = a whole-block prefix + 1.
    sched.add(sim_request("after", [*shared[:8], 5], max_new_tokens=6, arrival_step=16, prefix_from="donor"))
    _check_against_generate(runner, sched, folder, hf_model, reference_greedy)
    firsts = {r.request_id: r for s in sched.steps for r in s.new_requests}
    assert firsts["while"].num_computed_tokens == 12
    assert firsts["while"].block_ids[:3] == tuple(sched.requests["donor"].blocks[:3])
    assert firsts["after"].num_computed_tokens == 8
    assert any("donor" in s.finished_request_ids for s in sched.steps[:16])


def _naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Query row i (position start + i) over keys 0..start + i; GQA by repeating K/V heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    allowed = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_torch_backend_against_naive_attention(cache_dtype: torch.dtype) -> None:
    """Three sequences (a decode, a chunk after context, a fresh prefill) over scattered blocks."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, scale = 4, 2, 16, 4, 0.5
    k_cache = torch.zeros(20, bs, kv_heads, dim).to(cache_dtype)
    v_cache = torch.zeros(20, bs, kv_heads, dim).to(cache_dtype)
    seqs = [(9, 1, [7, 3, 12]), (10, 4, [5, 9, 1]), (6, 6, [2, 14])]  # (seq_len, new, block table)
    backend = TorchAttentionBackend()
    keys = [torch.randn(n, kv_heads, dim) for n, _, _ in seqs]
    values = [torch.randn(n, kv_heads, dim) for n, _, _ in seqs]
    for (n, _, table), key, value in zip(seqs, keys, values, strict=True):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        pad, junk = torch.tensor([-1, -1]), torch.full((2, kv_heads, dim), 99.0)  # padding: never written
        backend.write_kv(
            torch.cat((key, junk)),
            torch.cat((value, junk)),
            k_cache,
            v_cache,
            torch.cat((slots, pad)),
            k_scale=scale,
            v_scale=scale,
        )
    assert k_cache.float().abs().max() < 99 * (1 if cache_dtype == torch.float32 else scale)
    q = torch.randn(sum(new for _, new, _ in seqs), heads, dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
        query_start_loc=torch.tensor([0, 1, 5, 11], dtype=torch.int32),
        seq_lens=torch.tensor([n for n, _, _ in seqs], dtype=torch.int32),
        block_tables=torch.tensor([[7, 3, 12], [5, 9, 1], [2, 14, 0]], dtype=torch.int32),
        max_query_len=6,
        max_seq_len=10,
    )
    out = backend.forward(q, k_cache, v_cache, meta, 1 / math.sqrt(dim), k_scale=scale, v_scale=scale)
    rows = [0, 1, 5, 11]
    for i, (n, new, _) in enumerate(seqs):
        k, v = keys[i], values[i]
        if cache_dtype != torch.float32:  # what the cache holds: x / scale in fp8, times scale
            k = (k / scale).to(cache_dtype).float() * scale
            v = (v / scale).to(cache_dtype).float() * scale
        expected = _naive_attention(q[rows[i] : rows[i + 1]], k, v, n - new)
        torch.testing.assert_close(out[rows[i] : rows[i + 1]], expected, atol=1e-5, rtol=1e-5)
    if cache_dtype != torch.float32:
        exact = _naive_attention(q[1:5], keys[1], values[1], 6)
        assert F.cosine_similarity(out[1:5].flatten(), exact.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("group_bytes", [1, 3 * 12 * 2 * 16 * 4, 1 << 30])  # pairs, ~3 seqs, all in one group
def test_torch_backend_decode_groups(group_bytes: int) -> None:
    """Decodes of different lengths, split by a prefill chunk (so a group's rows are not consecutive),
    attended in groups of any size: every row still matches naive attention, layer after layer."""
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    lens = [9, 3, 12, 6, 1, 7]  # context after this step; sequence 2 is a 4-row chunk, the others decode
    new = [1, 1, 4, 1, 1, 1]
    tables = [[3, 8, 1], [17], [5, 2, 11], [6, 15], [4], [9, 13]]
    k_cache = torch.randn(20, bs, kv_heads, dim)
    v_cache = torch.randn(20, bs, kv_heads, dim)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(new), dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(new),
        max_seq_len=max(lens),
    )
    backend = TorchAttentionBackend(group_bytes=group_bytes)
    starts = meta.query_start_loc.tolist()
    for _layer in range(2):  # the second call reuses the step's plan
        q = torch.randn(sum(new), heads, dim)
        out = backend.forward(q, k_cache, v_cache, meta, 1 / math.sqrt(dim))
        for i, (n, table) in enumerate(zip(lens, tables, strict=True)):
            slots = [table[p // bs] * bs + p % bs for p in range(n)]
            k = k_cache.flatten(0, 1)[slots]
            v = v_cache.flatten(0, 1)[slots]
            expected = _naive_attention(q[starts[i] : starts[i + 1]], k, v, n - new[i])
            torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_hf_reference_fixture_is_plain_generate(
    checkpoint: Callable[[str], Path], hf_model: Any, reference_greedy: Any
) -> None:
    """Guards the reference itself: a second call is deterministic and has the requested length."""
    model = hf_model(checkpoint("llama"))
    first = reference_greedy(model, _prompt(3, 5), 7)
    assert len(first) == 7 and first == reference_greedy(model, _prompt(3, 5), 7)
