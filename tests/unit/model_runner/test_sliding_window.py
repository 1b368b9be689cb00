"""Sliding-window models through the real :class:`ModelRunner`, token for token against
transformers' ``generate()`` (fp32), at lengths far past the window.

Four tiny random checkpoints: Mistral (every layer one window: one KV cache group), Qwen2 with
``use_sliding_window`` + ``max_window_layers`` (layer 0 full, the rest windowed: three groups of
one layer), Qwen2 with an alternating ``layer_types`` list (Gemma-style: two groups of two) and
Qwen3 (per-head q/k norms; two full layers, then two windowed).

:class:`WindowDriver` plays the kv-cache-manager and scheduler as issue 16 defines them: one block
table per group, sent group-major; chunked prefill; a second request that hits the first one's
prefix (``num_computed_tokens > 0`` over the blocks the first one wrote, with 0 in its window
tables before the window); and every window block that slid out of every query's window freed at
once, its contents overwritten with NaN while it is free and with random garbage when it is handed
to the next allocation, while the runner still holds the old id. Any read outside a window would
turn a row NaN or change a token.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from services.model_runner.model.native_layers import NativeDecoderModel
from services.model_runner.runner import ModelRunner
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput
from shared.errors import InvalidArgument
from shared.kv_layout import dead_blocks
from shared.sampling_params import SamplingParams

TINY: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 320, "max_position_embeddings": 512, "initializer_range": 0.2, "bos_token_id": 1,
    "eos_token_id": None, "pad_token_id": 0,
}  # fmt: skip
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral": ("mistral", {"num_hidden_layers": 2, "sliding_window": 16}),
    "qwen2_max_window_layers": ("qwen2", {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 32,
                                          "max_window_layers": 1}),
    "qwen2_alternating": ("qwen2", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 24,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # q_norm / k_norm per head; layers 0-1 full, 2-3 a window of 20
    "qwen3_max_window_layers": ("qwen3", {"num_hidden_layers": 4, "head_dim": 16, "use_sliding_window": True,
                                          "sliding_window": 20, "max_window_layers": 2}),
}  # fmt: skip
GROUP_WINDOWS = {"mistral": (16,), "qwen2_max_window_layers": (None, 32, 32), "qwen2_alternating": (None, 24),
                 "qwen3_max_window_layers": (None, 20)}  # fmt: skip
POOL_SLOTS = {"mistral": 2, "qwen2_max_window_layers": 1, "qwen2_alternating": 2, "qwen3_max_window_layers": 2}


@pytest.fixture(scope="module")
def window_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model_type, overrides = CHECKPOINTS[name]
            config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
            torch.manual_seed(7)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            built[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(built[name], safe_serialization=True)
        return built[name]

    return get


class _Req:
    def __init__(self, rid: str, prompt: list[int], max_new: int, groups: int):
        self.rid, self.prompt, self.max_new = rid, prompt, max_new
        self.output: list[int] = []
        self.tables: list[list[int]] = [[] for _ in range(groups)]
        self.sent = 0  # blocks per group the runner knows
        self.computed = 0
        self.started = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class WindowDriver:
    """Allocates per-group block tables, frees window blocks as they slide out (with NaN written
    into them), reference-counts blocks a prefix hit shares."""

    def __init__(self, runner: ModelRunner, chunk: int):
        self.runner, self.chunk = runner, chunk
        self.bs = runner.pool.block_size
        self.windows = runner.model_info().kv_group_windows
        self.free = list(range(1, runner.pool.num_blocks))
        self.refs: dict[int, int] = {}
        self.requests: dict[str, _Req] = {}
        self.step_id = 0
        self.finished: list[str] = []
        self.ready: set[str] = set()  # requests allowed to start
        self.garbage = torch.Generator().manual_seed(0)
        self.held: dict[str, set[int]] = {}  # every id sent to the runner, per unfinished request
        self.freed = 0  # window blocks freed and poisoned (the test checks some were)
        self.reused = 0  # allocations of a block id a runner table still holds (stale: slid out)

    def add(self, rid: str, prompt: list[int], max_new: int) -> _Req:
        self.requests[rid] = _Req(rid, prompt, max_new, len(self.windows))
        return self.requests[rid]

    def share_prefix(self, req: _Req, donor: _Req, num_tokens: int) -> None:
        """``req`` starts with ``num_tokens`` computed, over ``donor``'s blocks (0 before the window)."""
        assert num_tokens % self.bs == 0 and donor.computed >= num_tokens and not req.started
        n = num_tokens // self.bs
        for g, window in enumerate(self.windows):
            live = dead_blocks(window, self.bs, num_tokens)
            req.tables[g] = [0] * live + donor.tables[g][live:n]
            assert 0 not in req.tables[g][live:], "the donor freed a block the hit needs"
            for block in req.tables[g][live:]:
                self.refs[block] += 1
        req.computed = num_tokens

    def _take(self) -> int:
        block = self.free.pop(0)
        self.refs[block] = 1
        if any(block in held for held in self.held.values()):
            self.reused += 1
            # NOTE: reused, it holds "another request's" data: finite garbage (a NaN tail past the
            # new owner's tokens would poison the torch path's masked reads inside a live block,
            # which real pools never hold)
            pool = self.runner.pool.tensor
            pool[:, :, block] = torch.randn(pool[:, :, block].shape, generator=self.garbage) * 10
        return block

    def _release(self, block: int) -> None:
        if block == 0:
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            self.runner.pool.tensor[:, :, block] = float("nan")  # whatever reads it turns NaN
            self.free.insert(0, block)  # reused first
            self.freed += 1

    def step(self) -> None:
        new, cached, scheduled = [], [], []
        for req in self.requests.values():
            if len(req.output) >= req.max_new or not (req.started or req.rid in self.ready):
                continue
            num_new = min(self.chunk, len(req.tokens) - req.computed)
            need = -(-(req.computed + num_new) // self.bs)
            for table in req.tables:
                table.extend(self._take() for _ in range(need - len(table)))
            if not req.started:
                ids = tuple(b for table in req.tables for b in table)
                new.append(NewRequestData(req.rid, tuple(req.tokens), len(req.prompt), ids, req.computed, num_new,
                                          SamplingParams()))  # fmt: skip
                req.started = True
            else:
                ids = tuple(b for table in req.tables for b in table[req.sent :])
                cached.append(CachedRequestData(req.rid, ids, req.computed, num_new))
            self.held.setdefault(req.rid, set()).update(ids)
            req.sent = need
            req.computed += num_new
            scheduled.append(req)
        out = self.runner.execute(StepInput(self.step_id, tuple(new), tuple(cached), tuple(self.finished)))
        self.finished = []
        self.step_id += 1
        for token in out.sampled:
            req = self.requests[token.request_id]
            req.output.append(token.token_id)
            if len(req.output) >= req.max_new:
                self.finished.append(req.rid)
                del self.held[req.rid]
                for table in req.tables:
                    for block in table:
                        self._release(block)
                    table[:] = [0] * len(table)
        for req in scheduled:  # window blocks no later query of the request can see go back
            if req.rid in self.finished:
                continue
            for g, window in enumerate(self.windows):
                if window is None:
                    continue
                live = dead_blocks(window, self.bs, req.computed)
                for j in range(live):
                    self._release(req.tables[g][j])
                    req.tables[g][j] = 0


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _scenario(driver: WindowDriver, prompt_len: int, hit: int, max_new: int) -> None:
    """``a`` prefills in chunks; ``b`` hits ``a``'s first ``hit`` tokens once ``a`` computed them
    (both then run side by side); ``c`` arrives while they decode."""
    a = driver.add("a", _prompt(1, prompt_len), max_new)
    b = driver.add("b", a.prompt[:hit] + _prompt(2, prompt_len // 3), max_new)
    driver.add("c", _prompt(3, 11), max_new)
    driver.ready = {"a"}
    while not all(len(r.output) >= r.max_new for r in driver.requests.values()):
        assert driver.step_id < 400, "the driver did not finish"
        if not b.started and "b" not in driver.ready and a.computed >= hit:
            driver.share_prefix(b, a, hit)
            driver.ready.add("b")
        if a.output and "c" not in driver.ready:
            driver.ready.add("c")
        driver.step()
    driver.step()  # tells the runner the last ones finished


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_greedy_matches_generate_past_the_window(
    name: str, backend: str, window_checkpoint: Any, hf_model: Any, make_runner: Any, reference_greedy: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``cpu``: decode-only steps of the one-group Mistral run the native decode stack with its
    window; the multi-group models' run layer by layer (docs/kv_layout.md), as Qwen3's do anyway."""
    folder = window_checkpoint(name)
    runner = make_runner(folder, num_blocks=400, backend=backend)
    info = runner.model_info()
    assert info.kv_group_windows == GROUP_WINDOWS[name] and info.max_model_len == 512
    assert runner.pool.shape[0] == POOL_SLOTS[name]
    assert info.bytes_per_block == runner.pool.shape[0] * 2 * 4 * 2 * 16 * 4  # slots x K,V x block x KV x D x fp32
    stacked: list[bool] = []
    has_stack = isinstance(runner.model.model, NativeDecoderModel)
    assert has_stack == (backend == "cpu" and not name.startswith("qwen3"))  # Qwen3's q/k norms: never stacked
    if has_stack:
        stack = runner.model.model.stack
        run = stack.run

        def spy(*args: Any) -> Any:
            result = run(*args)
            stacked.append(result is not None)
            return result

        monkeypatch.setattr(stack, "run", spy)
    driver = WindowDriver(runner, chunk=96)
    _scenario(driver, prompt_len=300, hit=192, max_new=12)
    assert driver.freed > 50 and driver.reused > 0
    if has_stack:
        assert any(stacked) == (name == "mistral")
    model = hf_model(folder)
    for rid, req in driver.requests.items():
        assert req.output == reference_greedy(model, req.prompt, req.max_new), rid
    assert runner.request_ids == frozenset()


def test_triton_backend_small(window_checkpoint: Any, hf_model: Any, make_runner: Any, reference_greedy: Any) -> None:
    """The Triton kernels under the interpreter on a short scenario (still 3x the window)."""
    folder = window_checkpoint("qwen2_alternating")
    runner = make_runner(folder, num_blocks=120, backend="triton")
    driver = WindowDriver(runner, chunk=24)
    _scenario(driver, prompt_len=72, hit=48, max_new=4)
    assert driver.freed > 0
    model = hf_model(folder)
    for rid, req in driver.requests.items():
        assert req.output == reference_greedy(model, req.prompt, req.max_new), rid


def test_group_major_ids_are_validated_and_a_bad_step_changes_nothing(
    window_checkpoint: Any, make_runner: Any
) -> None:
    runner = make_runner(window_checkpoint("qwen2_alternating"), num_blocks=40)
    prompt = _prompt(4, 30)  # 8 blocks of 4 per group
    full, window = list(range(1, 9)), list(range(20, 28))
    # a prefix hit computed from 28: its first query's window of 24 starts at key 5, in block 1
    bad = (*full, 0, 0, *window[2:])
    with pytest.raises(InvalidArgument, match=r"block id 0 \(KV cache group 1, block 1\)"):
        runner.execute(StepInput(0, (NewRequestData("a", tuple(prompt), 30, bad, 28, 2, SamplingParams()),)))
    assert runner.request_ids == frozenset()
    hit = (*full, 0, *window[1:])  # block 0 (keys 0..3) lies wholly before it: 0 is fine
    out = runner.execute(StepInput(1, (NewRequestData("a", tuple(prompt), 30, hit, 28, 2, SamplingParams()),)))
    assert [t.request_id for t in out.sampled] == ["a"] and runner.request_ids == {"a"}
    token = out.sampled[0].token_id
    with pytest.raises(InvalidArgument, match="3 new block ids do not split into 2 equal runs"):
        runner.execute(StepInput(2, cached_requests=(CachedRequestData("a", (30, 31, 32), 30, 1),)))
    out = runner.execute(StepInput(3, cached_requests=(CachedRequestData("a", (9, 30), 30, 1),)))
    assert [t.request_id for t in out.sampled] == ["a"]
    assert runner._requests["a"].block_ids == [*full, 9, 0, *window[1:], 30]  # each group's run appended
    assert runner._requests["a"].token_ids == [*prompt, token, out.sampled[0].token_id]


@pytest.mark.parametrize("name", ["mistral", "qwen2_alternating"])
def test_native_default_mode_is_bitwise_however_the_prompt_is_chunked(
    name: str, window_checkpoint: Any, make_runner: Any, all_logits: Any, hf_model: Any
) -> None:
    """The ``cpu`` backend under a window: a 200-token prompt in one pass or in chunks (one of a
    single token: a decode row) gives bitwise the same logits, close to transformers'."""
    folder = window_checkpoint(name)
    runner = make_runner(folder, num_blocks=200, backend="cpu")
    tokens = _prompt(5, 200)
    one_pass = all_logits(runner, tokens)
    assert torch.equal(all_logits(runner, tokens, chunks=[64, 1, 70, 65]), one_pass)
    with torch.inference_mode():
        expected = hf_model(folder)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(one_pass, expected, atol=1e-4, rtol=0)
