"""Tiny random-weight checkpoints (built with transformers, loaded through our loader) and a
miniature scheduler that drives :class:`ModelRunner` with hand-built steps.

Checkpoints are built once per session: hidden 64, 4 heads, 2 K/V heads, fp32. The init range is
raised to 0.2: with HF's default (0.02) the logits are near-uniform and greedy decoding repeats
one token, which would test little; at 0.2 outputs vary and the top-2 logit margins (>= ~1e-3)
dwarf fp32 rounding differences between two implementations (~1e-6).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from services.model_runner.factory import make_backend
from services.model_runner.input_batch import ScheduledRequest, prepare_inputs
from services.model_runner.kv_pool import KVPool, bytes_per_block, kv_dtype_for
from services.model_runner.loader import load_model
from services.model_runner.model.context import ForwardContext
from services.model_runner.runner import ModelRunner
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput, StepOutput
from shared.kv_layout import layers_per_group
from shared.sampling_params import SamplingParams

TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": None,  # generate() must not stop early: outputs are compared token by token
    "pad_token_id": 0,
}
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_hidden_layers": 3}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),  # qkv bias, tied embeddings
    "mistral": ("mistral", {"head_dim": 32, "num_hidden_layers": 2}),  # head_dim != hidden / heads
    "llama3": (
        "llama",
        {
            "num_key_value_heads": 1,
            "num_hidden_layers": 4,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "llama_linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # an intermediate size of whole 48-column weight panels: bf16 mode's fused gate_up + SwiGLU runs
    "llama_panels": ("llama", {"intermediate_size": 96, "num_hidden_layers": 2}),
    # every layer one window of 6 keys (one KV cache group): chunks whose window starts past block 0
    "mistral_window": ("mistral", {"head_dim": 32, "num_hidden_layers": 2, "sliding_window": 6}),
}
BLOCK_SIZE = 4


def build_checkpoint(folder: Path, name: str, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Saves a tiny random model of one of :data:`CHECKPOINTS` as safetensors into ``folder``."""
    model_type, overrides = CHECKPOINTS[name]
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(name)`` -> folder of that tiny checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def build() -> Callable[..., Path]:
    """:func:`build_checkpoint` (for tests that need a checkpoint of their own, e.g. sharded)."""
    return build_checkpoint


@pytest.fixture(scope="session")
def hf_model() -> Callable[[Path], PreTrainedModel]:
    """``hf_model(folder)`` -> the transformers reference model of a checkpoint, fp32, eval."""
    cache: dict[Path, PreTrainedModel] = {}

    def get(folder: Path) -> PreTrainedModel:
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        return cache[folder]

    return get


@pytest.fixture
def make_runner(tmp_path: Path) -> Any:
    """``make_runner(folder, num_blocks=64, kv_cache_dtype="auto", quantization="none", backend="torch",
    gemm_dtype="float32", hadamard=False)`` -> a runner on a fresh shm pool (``backend`` as in
    ``RunnerConfig.attention_backend``; ``gemm_dtype="bfloat16"``: bf16 mode on the native kernels;
    ``hadamard``: an int4 pool's rotation)."""
    runners: list[ModelRunner] = []

    def make(
        folder: Path, num_blocks: int = 64, kv_cache_dtype: str = "auto", quantization: str = "none",
        backend: str = "torch", gemm_dtype: str = "float32", hadamard: bool = False,
    ) -> ModelRunner:
        model, config = load_model(folder)
        dtype = kv_dtype_for(kv_cache_dtype, torch.float32)
        planes, heads, dim = config.kv_cache_geometry  # (2, KV heads, head_dim); MLA: (1, 1, latent + rope)
        slots = layers_per_group(config.kv_groups)
        per_block = bytes_per_block(slots, BLOCK_SIZE, heads, dim, dtype, planes)
        pool = KVPool(
            num_layers=config.num_layers,
            layer_slots=slots,
            num_kv_heads=heads,
            head_dim=dim,
            block_size=BLOCK_SIZE,
            memory_bytes=num_blocks * per_block,
            dtype=dtype,
            planes=planes,
            hadamard=hadamard,
        )
        mla = config.kv_layout == "mla"
        runner = ModelRunner(model, pool, make_backend(backend, torch.device("cpu"), mla=mla), model_id=folder.name,
                                 quantization=quantization, gemm_dtype=gemm_dtype)
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.pool.close()


@dataclass
class SimRequest:
    """A request as the miniature scheduler tracks it."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    arrival_step: int = 0
    prefix_from: str | None = None  # reuse this earlier request's full prompt blocks
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    started: bool = False
    sent_blocks: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


class MiniScheduler:
    """Just enough of a scheduler to drive the runner: a free-list block allocator, chunked
    prefill under a per-request chunk limit, arrivals at given steps, and prefix reuse.

    A request with ``prefix_from`` gets, when it arrives, the blocks of that request's prompt that
    are full (capped at ``len(prompt) - 1`` tokens) as ``num_computed_tokens``; those blocks are
    never freed while shared (this test scheduler simply keeps every block of a finished request
    that another request may still read).
    """

    def __init__(self, runner: ModelRunner, chunk: int = 1 << 30):
        self.runner = runner
        self.chunk = chunk
        self.block_size = runner.pool.block_size
        self.free = list(range(1, runner.pool.num_blocks))
        self.requests: dict[str, SimRequest] = {}
        self.step_id = 0
        self.pending_finished: list[str] = []
        self.steps: list[StepInput] = []

    def add(self, req: SimRequest) -> None:
        self.requests[req.request_id] = req

    def _allocate(self, req: SimRequest, upto: int) -> None:
        need = -(-upto // self.block_size) - len(req.blocks)
        for _ in range(need):
            req.blocks.append(self.free.pop(0))

    def step(self) -> StepOutput:
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        scheduled: list[SimRequest] = []
        for req in self.requests.values():
            if req.done or req.arrival_step > self.step_id:
                continue
            if not req.started and req.prefix_from is not None:
                donor = self.requests[req.prefix_from]
                shared = min(len(req.prompt) - 1, len(donor.prompt)) // self.block_size
                shared = min(shared, _common_prefix(req.prompt, donor.prompt) // self.block_size)
                assert donor.num_computed >= shared * self.block_size, "donor blocks not computed yet"
                req.blocks = donor.blocks[:shared]
                req.num_computed = shared * self.block_size
            num_new = min(self.chunk, len(req.tokens) - req.num_computed)
            self._allocate(req, req.num_computed + num_new)
            if not req.started:
                new.append(
                    NewRequestData(
                        req.request_id, tuple(req.tokens), len(req.prompt), tuple(req.blocks),
                        req.num_computed, num_new, SamplingParams(),
                    )
                )  # fmt: skip
                req.started = True
            else:
                cached.append(
                    CachedRequestData(req.request_id, tuple(req.blocks[req.sent_blocks :]), req.num_computed, num_new)
                )
            req.sent_blocks = len(req.blocks)
            req.num_computed += num_new
            scheduled.append(req)
        step = StepInput(self.step_id, tuple(new), tuple(cached), tuple(self.pending_finished))
        self.steps.append(step)
        self.pending_finished = []
        out = self.runner.execute(step)
        sampled_ids = {t.request_id for t in out.sampled}
        for req in scheduled:  # a request samples exactly when its scheduled tokens reach its end
            assert (req.request_id in sampled_ids) == (req.num_computed == len(req.tokens)), req.request_id
        for token in out.sampled:
            req = self.requests[token.request_id]
            req.output.append(token.token_id)
            if req.done:
                self.pending_finished.append(req.request_id)
        self.step_id += 1
        return out

    def flush(self) -> StepOutput:
        """A step that only tells the runner which requests finished."""
        step = StepInput(self.step_id, finished_request_ids=tuple(self.pending_finished))
        self.pending_finished = []
        self.step_id += 1
        return self.runner.execute(step)

    def run(self, max_steps: int = 500) -> dict[str, list[int]]:
        """Steps until every request has its tokens; returns each request's output."""
        while not all(r.done for r in self.requests.values()):
            if self.step_id >= max_steps:
                raise RuntimeError("the simulated scheduler did not finish")
            self.step()
        return {rid: r.output for rid, r in self.requests.items()}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture
def mini_scheduler() -> type[MiniScheduler]:
    """The :class:`MiniScheduler` class (tests build one per runner)."""
    return MiniScheduler


@pytest.fixture
def sim_request() -> type[SimRequest]:
    """The :class:`SimRequest` class."""
    return SimRequest


def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of ``prompt``."""
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=0, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def forward_all_logits(
    runner: ModelRunner, token_ids: Sequence[int], chunks: Sequence[int] | None = None
) -> torch.Tensor:
    """``[len(token_ids), V]`` logits of every position, prefilled through the runner's model and
    pool (blocks 1..n) in the given chunk sizes; the pool's fp8 scales apply."""
    chunks = list(chunks or [len(token_ids)])
    bs = runner.pool.block_size
    blocks = list(range(1, len(runner.groups) * -(-len(token_ids) // bs) + 1))  # group-major
    rows = []
    done = 0
    for size in chunks:
        req = ScheduledRequest("probe", list(token_ids), blocks, done, size)
        batch = prepare_inputs([req], runner.geometry)
        ctx = ForwardContext(runner.pool.tensor, runner.pool.layer_scales(), batch.meta, runner.backend,
                             group_metas=batch.metas, kv_rotation=runner.pool.rotation)
        with torch.inference_mode():
            rows.append(runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, ctx)))
        done += size
    return torch.cat(rows)


@pytest.fixture(scope="session")
def all_logits() -> Callable[..., torch.Tensor]:
    """:func:`forward_all_logits`."""
    return forward_all_logits


@pytest.fixture(scope="session")
def reference_greedy() -> Callable[[PreTrainedModel, Sequence[int], int], list[int]]:
    """``reference_greedy(hf_model, prompt, n)`` -> ``model.generate(do_sample=False)``'s new tokens."""
    return hf_greedy
