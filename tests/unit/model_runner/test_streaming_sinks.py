"""Attention-sinks mode (StreamingLLM) in the model-runner: the same greedy tokens as the reference.

The reference (``streaming_reference.py``) is written on transformers' own modules, one token at a
time over a dense cache; the runner runs the paged pool with chunked prefill and batched decodes.
Streams go far past ``sinks + window`` (where the rule starts to drop, and the outputs differ from
``generate()``). The bounded-memory test over the kv-cache-manager is tests/unit/scheduler/test_sinks_engine.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from services.model_runner.client import RunnerInfo
from services.model_runner.config import RunnerConfig
from services.model_runner.convert import model_info_from_proto, model_info_to_proto
from services.model_runner.factory import build_runner, make_backend
from services.model_runner.input_batch import ScheduledRequest, prepare_inputs
from services.model_runner.kv_pool import KVPool, bytes_per_block, kv_dtype_for
from services.model_runner.loader import load_model
from services.model_runner.runner import ModelRunner
from services.model_runner.streaming import STREAMING_MAX_MODEL_LEN
from shared.errors import FailedPrecondition, InvalidArgument
from tests.unit.model_runner.conftest import BLOCK_SIZE, MiniScheduler, SimRequest
from tests.unit.model_runner.streaming_reference import streaming_generate

SINKS, WINDOW = 4, 16


@pytest.fixture
def sink_runner() -> Iterator[Callable[..., ModelRunner]]:
    """``sink_runner(folder, num_blocks=400, sinks=4, window=16, backend="torch", kv_cache_dtype="auto")``."""
    runners: list[ModelRunner] = []

    def make(folder: Path, num_blocks: int = 400, sinks: int = SINKS, window: int = WINDOW,
             backend: str = "torch", kv_cache_dtype: str = "auto") -> ModelRunner:
        model, config = load_model(folder)
        dtype = kv_dtype_for(kv_cache_dtype, torch.float32)
        per_block = bytes_per_block(config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype)
        pool = KVPool(num_layers=config.num_layers, layer_slots=config.num_layers, num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, block_size=BLOCK_SIZE, memory_bytes=num_blocks * per_block,
                      dtype=dtype)  # fmt: skip
        try:
            runner = ModelRunner(model, pool, make_backend(backend, torch.device("cpu")), model_id=folder.name,
                                 streaming_sinks=sinks, streaming_window=window)  # fmt: skip
        except Exception:
            pool.close()
            raise
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.pool.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3"])
def test_a_stream_past_the_window_matches_the_reference(
    name: str, checkpoint: Callable[[str], Path], hf_model: Callable[[Path], PreTrainedModel],
    sink_runner: Callable[..., ModelRunner],
) -> None:
    folder = checkpoint(name)
    prompt = _prompt(30)
    sim = MiniScheduler(sink_runner(folder), chunk=7)
    sim.add(SimRequest("a", prompt, 150))
    # 30 + 150 tokens: the rule drops the middle from position 20 on
    assert sim.run(400)["a"] == streaming_generate(hf_model(folder), prompt, 150, SINKS, WINDOW)


@pytest.mark.parametrize("chunk", [1, 13, 1 << 30])
def test_chunked_prefill_of_a_long_prompt_matches_the_reference(
    chunk: int, checkpoint: Callable[[str], Path], hf_model: Callable[[Path], PreTrainedModel],
    sink_runner: Callable[..., ModelRunner],
) -> None:
    """A 120-token prompt (6x sinks + window) in chunks of 1, 13 and all at once: within one chunk
    every query row has keys of its own (its window), rotated at its own cache positions."""
    folder = checkpoint("llama")
    prompt = _prompt(120, seed=1)
    sim = MiniScheduler(sink_runner(folder), chunk=chunk)
    sim.add(SimRequest("a", prompt, 40))
    assert sim.run(400)["a"] == streaming_generate(hf_model(folder), prompt, 40, SINKS, WINDOW)


def test_batched_requests_each_match_the_reference(
    checkpoint: Callable[[str], Path], hf_model: Callable[[Path], PreTrainedModel],
    sink_runner: Callable[..., ModelRunner],
) -> None:
    folder = checkpoint("qwen2")
    prompts = {"a": _prompt(9, seed=2), "b": _prompt(50, seed=3), "c": _prompt(23, seed=4)}
    sim = MiniScheduler(sink_runner(folder), chunk=16)
    for i, (rid, prompt) in enumerate(prompts.items()):
        sim.add(SimRequest(rid, prompt, 60, arrival_step=3 * i))
    outputs = sim.run(400)
    for rid, prompt in prompts.items():
        assert outputs[rid] == streaming_generate(hf_model(folder), prompt, 60, SINKS, WINDOW), rid


def test_model_info_and_geometry(checkpoint: Callable[[str], Path], sink_runner: Callable[..., ModelRunner]) -> None:
    runner = sink_runner(checkpoint("llama"), num_blocks=12)
    info = runner.model_info()
    assert (info.kv_group_windows, info.kv_group_sink_tokens, info.max_model_len) == ((16,), (4,), 2**31 - 1)
    assert STREAMING_MAX_MODEL_LEN == 2**31 - 1
    back = model_info_from_proto(model_info_to_proto(info))
    assert back == info
    assert RunnerInfo.from_model_info(back).kv_group_sink_tokens == (4,)
    # A plain runner reports no sinks, and the empty field round-trips to empty.
    msg = model_info_to_proto(info)
    msg.ClearField("kv_group_sink_tokens")
    assert model_info_from_proto(msg).kv_group_sink_tokens == ()
    # Tables longer than the pool, with zeros where the middle was freed, are accepted; a zero at a
    # sink block or in the window is not.
    tokens = _prompt(200)
    table = [1] + [0] * 44 + [2, 3, 4, 5, 6]  # 50 blocks (the pool has 11): position 45 holds token 180
    prepare_inputs([ScheduledRequest("a", tokens, table, 196, 1)], runner.geometry)
    with pytest.raises(InvalidArgument, match="block id 0"):
        prepare_inputs([ScheduledRequest("a", tokens, [0, *table[1:]], 196, 1)], runner.geometry)
    with pytest.raises(InvalidArgument, match="block id 0"):
        prepare_inputs([ScheduledRequest("a", tokens, [*table[:45], 0, *table[46:]], 196, 1)], runner.geometry)


def test_what_the_mode_refuses(checkpoint: Callable[[str], Path], sink_runner: Callable[..., ModelRunner]) -> None:
    folder = checkpoint("llama")
    with pytest.raises(FailedPrecondition, match="torch attention backend only, not 'cpu'"):
        sink_runner(folder, backend="cpu")
    with pytest.raises(FailedPrecondition, match="fp8"):
        sink_runner(folder, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(FailedPrecondition, match="= 513 exceeds the model's max_position_embeddings 512"):
        sink_runner(folder, sinks=1, window=512)
    with pytest.raises(FailedPrecondition, match=r"every layer on full attention; this model has sliding windows"):
        sink_runner(checkpoint("mistral"))  # transformers' Mistral: sliding_window 4096 on every layer
    with pytest.raises(FailedPrecondition, match="both set or neither"):
        sink_runner(folder, sinks=4, window=0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"streaming_sinks": 4}, "must both be > 0"),
    ({"streaming_window": 16}, "must both be > 0"),
    ({"streaming_sinks": -1, "streaming_window": 16}, "must both be > 0"),
])
def test_runner_config_wants_both_or_neither(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunnerConfig(**fields)
    assert RunnerConfig(streaming_sinks=4, streaming_window=16).streaming


def test_the_factory_picks_torch_and_refuses_other_backends(checkpoint: Callable[[str], Path]) -> None:
    folder = str(checkpoint("llama"))
    base = {"model_dir": folder, "block_size": 4, "kv_cache_memory_bytes": 1 << 20, "warmup": True,
            "streaming_sinks": 4, "streaming_window": 16}
    for backend in ("triton", "cpu"):
        with pytest.raises(FailedPrecondition, match=f"torch attention backend only, not '{backend}'"):
            build_runner(RunnerConfig(**base, attention_backend=backend))
    runner = build_runner(RunnerConfig(**base))  # auto, and the warm-up runs in the mode
    try:
        info = runner.model_info()
        assert (info.attention_backend, info.dtype, info.kv_group_sink_tokens) == ("torch", "float32", (4,))
        assert info.attention_backend_reason == "auto: attention sinks (streaming_sinks) run on the torch backend only"
    finally:
        runner.pool.close()


def test_attention_reads_only_the_visible_keys() -> None:
    """Every slot a query cannot see (the freed middle, the null block that pads a short row, other
    requests' blocks) set to NaN: the output is bitwise the same."""
    from services.model_runner.attention.base import AttentionMetadata
    from services.model_runner.attention.streaming import StreamingAttention, visible_slots
    from services.model_runner.model.config import RopeConfig
    from services.model_runner.model.layers import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 40, BLOCK_SIZE, 2, 8, generator=g).unbind(0)  # [blocks, bs, KV, D]
    tables = torch.randperm(39, generator=g)[:36].add(1).view(3, 12).int()  # three sequences, 12 blocks each
    starts, lens = [0, 5, 6, 7], [45, 30, 6]  # a chunk of 5 rows, a decode far past k + W, a short decode
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(7, dtype=torch.int64), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, max_query_len=5, max_seq_len=45,
        window=WINDOW,
    )  # fmt: skip
    rotary = RotaryEmbedding(RopeConfig(), 8, 64)
    attention = StreamingAttention(rotary.cos, rotary.sin, SINKS, WINDOW)
    query = torch.randn(7, 4, 8, generator=g)
    before = attention.forward(query, k_cache, v_cache, meta, 0.3, apply_rotary)
    slots, valid = visible_slots(starts, lens, tables.numpy().astype("int64"), BLOCK_SIZE, SINKS, WINDOW)
    assert valid.sum(1).tolist() == [20] * 6 + [6]  # k + W keys per row far past k + W, else every key
    assert slots[6, 6:].tolist() == [0] * 14  # the short row's padding: the null block
    assert slots[5, :4].tolist() == [int(tables[1, 0]) * BLOCK_SIZE + j for j in range(4)]  # the sinks first
    seen = torch.zeros(40 * BLOCK_SIZE, dtype=torch.bool)
    seen[torch.from_numpy(slots[valid])] = True
    for cache in (k_cache, v_cache):
        cache.view(-1, 2, 8)[~seen] = float("nan")
    fresh = StreamingAttention(rotary.cos, rotary.sin, SINKS, WINDOW)
    assert torch.equal(fresh.forward(query, k_cache, v_cache, meta, 0.3, apply_rotary), before)
