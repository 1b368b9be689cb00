"""The model-runner's core: executes scheduler steps against the model and the paged KV pool.

It keeps, per request, what the scheduler does not send again: the tokens known so far, the
block table and the sampling state. ``execute`` validates the whole step first, runs all of the
step's tokens through the model in one forward, samples, and only then commits the new state;
so a bad request (or a failed forward) leaves every request as it was.

Block tables are kept per KV cache group (``shared/kv_layout.py``), group-major as they travel:
a cached request's new block ids are one equal run per group, appended to that group's table.

Attention-sinks mode (``streaming_sinks``/``streaming_window``, StreamingLLM; docs/kv_layout.md):
every layer is one window group that keeps its sink tokens, attention goes through
``attention/streaming.py``, the model rotates each query at its cache position, and
``max_model_len`` no longer bounds a stream by the model's positions (:data:`STREAMING_MAX_MODEL_LEN`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.model_runner.attention.base import AttentionBackend, AttentionMetadata
from services.model_runner.attention.streaming import StreamingAttention
from services.model_runner.compute_thread import ComputeThread
from services.model_runner.input_batch import (
    PoolGeometry,
    ScheduledRequest,
    check_token_ids,
    extend_tables,
    prepare_inputs,
)
from services.model_runner.kv_pool import KVPool, row_elements
from services.model_runner.model.config import ModelConfig
from services.model_runner.model.context import ForwardContext
from services.model_runner.model.transformer import CausalLM
from services.model_runner.model.transforms import prepare_model
from services.model_runner.sampler import RequestSamplingState, plain_greedy, sample
from services.model_runner.streaming import STREAMING_MAX_MODEL_LEN, check_streaming
from services.model_runner.types import ModelInfo, NewRequestData, SampledLogprobs, SampledToken, StepInput, StepOutput
from shared.errors import FailedPrecondition, InvalidArgument
from shared.kv_layout import layers_per_group
from shared.sampling_params import SamplingParams


@dataclass
class _Request:
    """The runner's memory of one request between steps."""

    token_ids: list[int]  # prompt, then every sampled token
    block_ids: list[int]  # every KV cache group's table, group after group, all of one length
    num_computed_tokens: int
    sampling: RequestSamplingState


@dataclass(frozen=True)
class _Planned:
    """A validated request of the step: its new state (not yet committed) and its slice of the batch."""

    request_id: str
    state: _Request
    scheduled: ScheduledRequest
    block_ids: list[int]  # the request's tables after the step (``scheduled.block_ids``), never mutated


class ModelRunner:
    """Holds the model, the KV pool, the attention backend and the per-request state."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        *,
        model_id: str,
        max_model_len: int | None = None,
        quantization: str = "none",
        pack_tied_head: bool = True,
        screen_head: bool = True,
        dtype_reason: str = "",
        attention_backend_reason: str = "",
        gemm_dtype: str = "float32",
        streaming_sinks: int = 0,
        streaming_window: int = 0,
    ):
        """
        Args:
            model: a loaded model; the runner prepares it for ``quantization`` and the backend
                (see :func:`prepare_model`), so the model belongs to the runner from then on.
            pool: the paged KV cache.
            backend: writes K/V and computes attention.
            model_id: identity reported to the others.
            max_model_len: longest sequence; default and cap: the model's.
            quantization: ``none``, ``fp16`` or ``int8`` (``RunnerConfig.quantization``).
            pack_tied_head: see :func:`prepare_model` (``RunnerConfig.pack_tied_head``).
            screen_head: see :func:`prepare_model` (``RunnerConfig.screen_head``).
            dtype_reason, attention_backend_reason: why the factory chose the model's dtype and
                the backend (reported by :meth:`model_info`).
            gemm_dtype: ``bfloat16`` for bf16 mode on the native kernels (fp32 weights as
                loaded, packed to bf16; see :func:`prepare_model`), else ``float32``.
            streaming_sinks, streaming_window: attention-sinks mode's ``k`` and ``W`` (both > 0),
                or 0 and 0 (``RunnerConfig``); ``max_model_len`` then defaults to, and may exceed
                the model's positions up to, :data:`STREAMING_MAX_MODEL_LEN`.

        Raises:
            FailedPrecondition: attention sinks asked for a model, backend or KV dtype they do
                not take (:func:`check_streaming`).
        """
        planes, heads, dim = model.config.kv_cache_geometry
        if (pool.shape[1], *pool.shape[4:]) != (planes, heads, row_elements(dim, pool.dtype)):
            raise FailedPrecondition(
                f"the KV pool {list(pool.shape)} is not laid out for this model's {model.config.kv_layout} KV "
                f"([layers, {planes}, blocks, block_size, {heads}, {dim}])")
        # NOTE: a backend on the native kernels ("cpu") brings the native norms, rotary, SwiGLU
        # and GEMMs with it: the model is prepared for the kernels the backend runs on.
        prepare_model(model, quantization, pack_tied_head, kernels=backend.native_kernels, gemm_dtype=gemm_dtype,
                      screen_head=screen_head)
        self.model = model
        self.config: ModelConfig = model.config
        self.pool = pool
        self.backend = backend
        # the thread the service runs every step on (factory.build_runner sets it; None: the caller's thread)
        self.compute: ComputeThread | None = None
        self.model_id = model_id
        self.device = pool.tensor.device
        self.max_model_len = min(max_model_len or self.config.max_model_len, self.config.max_model_len)
        self.groups = self.config.kv_groups
        self.streaming: StreamingAttention | None = None
        if streaming_sinks or streaming_window:
            self.groups = check_streaming(self.config, backend.name, pool.kv_cache_dtype, streaming_sinks,
                                          streaming_window)  # fmt: skip
            rotary = model.model.rotary
            self.streaming = StreamingAttention(rotary.cos, rotary.sin, streaming_sinks, streaming_window)
            self.max_model_len = min(max_model_len or STREAMING_MAX_MODEL_LEN, STREAMING_MAX_MODEL_LEN)
        if pool.shape[0] != layers_per_group(self.groups):
            raise ValueError(f"the pool has {pool.shape[0]} layer slots, this model's KV cache groups need "
                             f"{layers_per_group(self.groups)}")  # fmt: skip
        self.group_windows = tuple(group.window for group in self.groups)
        self.group_sink_tokens = tuple(g.sink_tokens for g in self.groups) if self.streaming is not None else ()
        self.geometry = PoolGeometry(pool.num_blocks, pool.block_size, self.config.vocab_size, self.max_model_len,
                                     self.group_windows, self.group_sink_tokens)  # fmt: skip
        self._requests: dict[str, _Request] = {}
        self._reasons = (dtype_reason, attention_backend_reason)

    @property
    def request_ids(self) -> frozenset[str]:
        """Requests the runner currently remembers."""
        return frozenset(self._requests)

    def execute(self, step: StepInput) -> StepOutput:
        """Runs one scheduler step.

        Finished ids are forgotten first (a new request may reuse one in the same step), then new
        requests are registered and cached ones extended; the step's tokens run in one forward.

        Returns:
            One :class:`SampledToken` per request whose scheduled tokens reached its last known
            token, in step order (new requests first).

        Raises:
            InvalidArgument: anything malformed; the runner's state is then unchanged.
        """
        planned = self._plan(step)
        start = time.perf_counter()
        sampled: list[SampledToken] = []
        if planned:
            batch = prepare_inputs([p.scheduled for p in planned], self.geometry, self.device)
            with torch.inference_mode():
                positions = self._rotary_positions(batch.positions)
                # [N, hidden]: only the rows sampled from leave the forward (ForwardContext.output_rows)
                rows = self.model(batch.input_ids, positions, self._context(batch.metas, batch.logits_indices))
                states = [planned[i].state.sampling for i in batch.sampling_requests]
                tokens = self.model.head_argmax(rows) if plain_greedy(states) else None
                if tokens is not None:  # every row greedy, nothing reported: no logits needed
                    results: list[tuple[int, SampledLogprobs | None]] = [(t, None) for t in tokens.tolist()]
                else:
                    results = sample(self.model.compute_logits(rows), states)  # [N, V] float32 logits
            for i, (token_id, logprobs) in zip(batch.sampling_requests, results, strict=True):
                sampled.append(SampledToken(planned[i].request_id, token_id, logprobs))
        # Commit: nothing above mutated the runner.
        for rid in step.finished_request_ids:
            self._requests.pop(rid, None)
        for p in planned:
            self._requests[p.request_id] = p.state
            p.state.num_computed_tokens += p.scheduled.num_new_tokens
            p.state.block_ids = p.block_ids
        for token in sampled:
            state = self._requests[token.request_id]
            state.token_ids.append(token.token_id)
            state.sampling.output_token_ids.append(token.token_id)
        return StepOutput(step.step_id, tuple(sampled), time.perf_counter() - start)

    def _plan(self, step: StepInput) -> list[_Planned]:
        """Validates the step against the state after its finished ids; mutates nothing."""
        finished = set(step.finished_request_ids)
        live = {rid: r for rid, r in self._requests.items() if rid not in finished} if finished else self._requests
        seen: set[str] = set()
        planned: list[_Planned] = []
        for new in step.new_requests:
            self._check_unique(new.request_id, seen)
            if new.request_id in live:
                raise InvalidArgument(f"{new.request_id}: already running (a new request needs a new id)")
            state = self._new_state(new)
            planned.append(
                _Planned(
                    new.request_id,
                    state,
                    ScheduledRequest(
                        new.request_id, state.token_ids, state.block_ids, new.num_computed_tokens, new.num_new_tokens
                    ),
                    state.block_ids,
                )
            )
        for cached in step.cached_requests:
            self._check_unique(cached.request_id, seen)
            if cached.request_id not in live:
                raise InvalidArgument(f"{cached.request_id}: unknown request (never sent as new, or finished)")
            state = live[cached.request_id]
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise InvalidArgument(
                    f"{cached.request_id}: num_computed_tokens {cached.num_computed_tokens} does not match "
                    f"the runner's {state.num_computed_tokens}"
                )
            blocks = extend_tables(cached.request_id, state.block_ids, cached.new_block_ids, len(self.groups))
            planned.append(
                _Planned(
                    cached.request_id,
                    state,
                    ScheduledRequest(
                        cached.request_id, state.token_ids, blocks, state.num_computed_tokens, cached.num_new_tokens
                    ),
                    blocks,
                )
            )
        return planned

    @staticmethod
    def _check_unique(request_id: str, seen: set[str]) -> None:
        if request_id in seen:
            raise InvalidArgument(f"{request_id}: appears twice in one step")
        seen.add(request_id)

    def _new_state(self, new: NewRequestData) -> _Request:
        rid = new.request_id
        if not new.token_ids:
            raise InvalidArgument(f"{rid}: no token ids")
        if not 0 < new.num_prompt_tokens <= len(new.token_ids):
            raise InvalidArgument(f"{rid}: num_prompt_tokens {new.num_prompt_tokens} not in [1, {len(new.token_ids)}]")
        if len(new.token_ids) > self.max_model_len:
            raise InvalidArgument(f"{rid}: {len(new.token_ids)} tokens exceed max_model_len {self.max_model_len}")
        check_token_ids(np.asarray(new.token_ids, dtype=np.int64), rid, self.config.vocab_size)
        new.sampling.validate(self.config.vocab_size)
        tokens = list(new.token_ids)
        prompt, outputs = tokens[: new.num_prompt_tokens], tokens[new.num_prompt_tokens :]
        sampling = RequestSamplingState.create(new.sampling, prompt, outputs)
        return _Request(tokens, list(new.block_ids), new.num_computed_tokens, sampling)

    def _context(self, metas: Sequence[AttentionMetadata], output_rows: torch.Tensor | None = None) -> ForwardContext:
        return ForwardContext(self.pool.tensor, self.pool.layer_scales(), metas[0], self.backend,
                              group_metas=tuple(metas), kv_rotation=self.pool.rotation,
                              streaming=self.streaming, output_rows=output_rows)  # fmt: skip

    def _rotary_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions the model rotates by: the text positions, or in attention-sinks mode each
        query's cache position (``attention/streaming.py``)."""
        return positions if self.streaming is None else self.streaming.rotary_positions(positions)

    def model_info(self) -> ModelInfo:
        """Model and pool geometry, for the scheduler and the kv-cache-manager to size themselves."""
        cfg = self.config
        return ModelInfo(
            model_id=self.model_id,
            architecture=cfg.architecture,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=cfg.eos_token_ids,
            bos_token_id=-1 if cfg.bos_token_id is None else cfg.bos_token_id,
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.kv_cache_geometry[1],
            head_dim=cfg.kv_cache_geometry[2],
            dtype=self.model.compute_dtype or str(self.model.model.norm.weight.dtype).removeprefix("torch."),
            kv_cache_dtype=self.pool.kv_cache_dtype,
            attention_backend=self.backend.name,
            bytes_per_block=self.pool.bytes_per_block,
            device=str(self.device),
            dtype_reason=self._reasons[0],
            attention_backend_reason=self._reasons[1],
            pool_id=self.pool.generation,
            kv_layout=cfg.kv_layout,
            kv_bytes_per_token=float(cfg.kv_bytes_per_token(self.pool.tensor.element_size())),
            kv_group_windows=self.group_windows,
            kv_group_sink_tokens=self.group_sink_tokens,
        )

    def warmup(self, num_tokens: int = 64, num_decodes: int = 4) -> float:
        """Runs a prefill-shaped and a decode-shaped forward plus sampling; returns the seconds taken.

        NOTE: every write goes to slot -1 (skipped) and every block table points at the null
        block, so warming up never touches a real block, even on a pool that holds cached prefixes.
        """
        start = time.perf_counter()
        num_tokens = max(1, min(num_tokens, self.max_model_len))
        for lens in ([num_tokens], [1] * num_decodes):
            q_lens = torch.tensor(lens, dtype=torch.int32)
            seq_lens = torch.full((len(lens),), num_tokens, dtype=torch.int32)
            metas = [AttentionMetadata(
                slot_mapping=torch.full((sum(lens),), -1, dtype=torch.int64, device=self.device),
                query_start_loc=torch.cat((torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int())).to(self.device),
                seq_lens=seq_lens.to(self.device),
                block_tables=torch.zeros(len(lens), -(-num_tokens // self.pool.block_size), dtype=torch.int32,
                                         device=self.device),
                max_query_len=max(lens),
                max_seq_len=num_tokens,
                window=window,
            ) for window in self.group_windows]  # fmt: skip
            input_ids = torch.zeros(sum(lens), dtype=torch.int64, device=self.device)
            positions = (seq_lens.repeat_interleave(q_lens) - 1).to(device=self.device, dtype=torch.int64)
            with torch.inference_mode():
                hidden = self.model(input_ids, self._rotary_positions(positions), self._context(metas))
                logits = self.model.compute_logits(hidden[-len(lens) :])
                sample(logits, [RequestSamplingState.create(SamplingParams(), [0]) for _ in lens])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def calibrate_kv_scales(self, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Sets the fp8 pool's per-layer scales from one forward over a sample; returns the amax.

        The sample runs against a scratch cache in the model's dtype (not the pool), so the
        observed K/V are unquantized and no real block is written.

        Args:
            token_ids: a representative prompt; default: 256 fixed pseudo-random tokens.

        Returns:
            ``[num_layers, 2]`` max ``|K|`` / ``|V|`` per layer.
        """
        if token_ids is None:
            generator = torch.Generator().manual_seed(0)
            count = min(256, self.max_model_len)
            token_ids = torch.randint(0, self.config.vocab_size, (count,), generator=generator).tolist()
        cfg, bs = self.config, self.pool.block_size
        per_group = -(-len(token_ids) // bs)
        num_blocks = per_group * len(self.groups) + 1
        dtype = self.model.model.norm.weight.dtype
        planes, heads, dim = cfg.kv_cache_geometry
        scratch = torch.zeros(self.pool.shape[0], planes, num_blocks, bs, heads, dim, dtype=dtype, device=self.device)
        geometry = PoolGeometry(num_blocks, bs, cfg.vocab_size, self.max_model_len, self.group_windows)
        req = ScheduledRequest("calibration", list(token_ids), list(range(1, num_blocks)), 0, len(token_ids))
        batch = prepare_inputs([req], geometry, self.device)
        amax = torch.zeros(cfg.num_layers, 2, dtype=torch.float32, device=self.device)
        ctx = ForwardContext(scratch, [(1.0, 1.0)] * cfg.num_layers, batch.meta, self.backend, kv_amax=amax,
                             group_metas=batch.metas)  # fmt: skip
        with torch.inference_mode():
            self.model(batch.input_ids, batch.positions, ctx)
        self.pool.calibrate(amax)
        return amax.cpu()

