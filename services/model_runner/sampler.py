"""Choosing the next token of every request in a batch from the model's last-position logits.

One step, for ``N`` rows of logits ``[N, V]`` and one :class:`RequestSamplingState` per row::

    raw logits ─► penalties ─┬─► log_softmax ─► reported logprobs (sampled token + top-n)
                             ├─► argmax ─────────────────────────► greedy rows (temperature 0)
                             └─► / temperature ─► top-k ─► top-p ─► min-p ─► inverse-CDF draw
                                                                             (random rows)

NOTE: reported logprobs come from the *penalized* logits before temperature and filtering. They
describe the distribution the request's penalties define, independent of how it was sampled
(a top-k=1 request still sees real alternatives). vLLM's default instead reports the raw model's
logprobs; ours differ from it only when a penalty is set.

NOTE: reproducibility. A seeded request owns a CPU ``torch.Generator`` and draws exactly one
uniform number from it per random step, whatever else shares the batch; the token is the first
whose cumulative probability (in token-id order) exceeds it. So the same seed, prompt and logits
give the same tokens in any batch composition or row order. One number per row rather than an
exponential race's ``V`` (``argmax(probs / q)``, ``q ~ Exp(1)``): ``V`` exponentials per row cost
a sizeable part of a step (docs/model_runner.md) and buy no extra reproducibility.
Unseeded rows draw from torch's default CPU generator (``torch.manual_seed`` fixes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.model_runner.types import SampledLogprobs, TokenLogprob
from shared.sampling_params import SamplingParams

TOP_CANDIDATES = 1024  # rows whose top-k/top-p fits in this many tokens skip the full sort


@dataclass
class RequestSamplingState:
    """What sampling needs to remember about one request between steps.

    The runner appends each sampled token to ``output_token_ids`` (``sample`` does not), so the
    penalties of the next step see it.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # seeded per request when params.seed is set

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> RequestSamplingState:
        """A fresh state; a request with ``params.seed`` gets its own generator seeded with it."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
        return cls(params, list(prompt_token_ids), list(output_token_ids), generator)


def sample(logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> list[tuple[int, SampledLogprobs | None]]:
    """Samples one token per row.

    Args:
        logits: ``[N, V]`` float logits, row ``i`` belonging to ``states[i]``. Not modified.
        states: the requests' sampling states; their token lists feed the penalties.

    Returns:
        ``(token_id, logprobs)`` per row, ``logprobs`` None unless ``params.logprobs`` is set.

    Raises:
        ValueError: on a shape mismatch or a penalty token id outside ``[0, V)``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"logits must be [len(states)={len(states)}, V], got {list(logits.shape)}")
    if not states:
        return []
    logits = apply_penalties(logits.float(), states)  # [N, V]; the input is not modified
    tokens = greedy_tokens(logits)  # [N]
    random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        random_logits = logits if len(random_rows) == len(states) else logits[rows]
        probs = filtered_probs(random_logits, [states[i].params for i in random_rows])
        tokens[rows] = _draw(probs, [states[i].generator for i in random_rows])
    token_list: list[int] = tokens.tolist()
    return list(zip(token_list, _logprobs(logits, token_list, states), strict=True))


def plain_greedy(states: Sequence[RequestSamplingState]) -> bool:
    """Whether every row's token is the argmax of the raw logits: greedy, no penalty, no logprobs.
    Such a step needs no logits, only their argmax (``CausalLM.head_argmax``)."""
    return all(s.params.is_greedy and s.params.logprobs is None and not _has_penalty(s.params) for s in states)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: each row's first maximum (the lowest id on ties; a NaN counts as the maximum),
    exactly ``logits.argmax(dim=-1)``.

    NOTE: a CPU float32 row goes through numpy's SIMD argmax: torch's CPU argmax over the last
    dimension is not vectorized and took a sizeable part of a batch-32 decode step at a 49k
    vocabulary (docs/model_runner.md, "Per-step overhead"). Both take the first maximum and treat
    NaN as larger than any number, so the tokens are the same (tests/unit/model_runner/test_sampler.py).
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
    """Repetition penalty (HF), then presence and frequency penalties (OpenAI / vLLM).

    Repetition: every token seen in the prompt or the output has a positive logit divided by the
    penalty and a negative one multiplied by it. Presence/frequency: over output tokens only,
    ``logit -= presence * (count > 0) + frequency * count``. Rows without penalties cost nothing.

    Returns:
        A new tensor, or ``logits`` itself when no row has a penalty (it is never modified).
    """
    if not any(_has_penalty(s.params) for s in states):
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    rep = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep:
        rows = torch.tensor(rep, device=device)
        seen_lists = [states[i].prompt_token_ids + states[i].output_token_ids for i in rep]
        seen = _token_counts(seen_lists, vocab, device) > 0  # [R, V]
        penalty = torch.tensor([states[i].params.repetition_penalty for i in rep], device=device)
        penalty = penalty.unsqueeze(1)  # [R, 1]
        sub = logits[rows]
        logits[rows] = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    additive = [i for i, s in enumerate(states) if s.params.presence_penalty or s.params.frequency_penalty]
    if additive:
        rows = torch.tensor(additive, device=device)
        counts = _token_counts([states[i].output_token_ids for i in additive], vocab, device)  # [A, V]
        presence = torch.tensor([states[i].params.presence_penalty for i in additive], device=device)
        frequency = torch.tensor([states[i].params.frequency_penalty for i in additive], device=device)
        logits[rows] -= presence.unsqueeze(1) * (counts > 0) + frequency.unsqueeze(1) * counts
    return logits


def filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams], candidates: int = TOP_CANDIDATES
) -> torch.Tensor:
    """The distribution each random row samples from: temperature, then top-k, top-p, min-p.

    Args:
        logits: ``[R, V]`` penalized logits of rows with temperature > 0.
        params: their sampling parameters.
        candidates: how many top tokens to try before a full sort (see :func:`_sorted_prefix`).

    Returns:
        ``[R, V]`` probabilities in token-id order, zero outside each row's kept set.

    Top-p keeps the smallest prefix (by descending probability, ties by lowest id) of the top-k
    renormalized distribution whose mass reaches ``top_p``; the most likely token is always kept.
    Min-p keeps tokens with ``p >= min_p * p_max``; being a ratio it does not care whether it is
    applied before or after the other filters renormalize.
    """
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)  # [R, 1]
    # NOTE: subtracting the max first keeps tiny temperatures finite: the best logit becomes 0,
    # the rest -large or -inf, so temperature -> 0 tends to argmax instead of producing NaN.
    # In place where possible: on the CPU every fresh [R, V] tensor costs page faults.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values).div_(temperature)
    vocab = scaled.shape[1]
    ordered = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if len(ordered) == len(params):
        probs = _top_k_top_p(scaled, params, candidates)
    else:
        probs = scaled.softmax(dim=-1)  # [R, V]
        if ordered:
            rows = torch.tensor(ordered, device=device)
            probs[rows] = _top_k_top_p(scaled[rows], [params[i] for i in ordered], candidates)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs.masked_fill_(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def _top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams], candidates: int) -> torch.Tensor:
    """``[S, V]`` probabilities, zero outside top-k / top-p, renormalized over what is kept."""
    vocab, device = scaled.shape[1], scaled.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)  # 2: off
    # NOTE: top-p is measured on the top-k renormalized distribution; with top-k off that is the
    # whole row, part of which may lie beyond the sorted columns, hence the full-row logsumexp.
    full_lse = None if bool((top_k < vocab).all()) else scaled.logsumexp(dim=-1)  # [S]
    values, order, limit = _sorted_prefix(scaled, top_k, top_p, full_lse, candidates)  # [S, C] x2, [S]
    position = torch.arange(values.shape[1], device=device).unsqueeze(0)
    in_top_k = position < top_k.unsqueeze(1)
    lse = values.masked_fill(~in_top_k, float("-inf")).logsumexp(dim=-1)
    if full_lse is not None:
        lse = torch.where(top_k < vocab, lse, full_lse)
    sorted_probs = (values - lse.unsqueeze(1)).exp_().masked_fill_(~in_top_k, 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_p.unsqueeze(1)) | (position >= limit.unsqueeze(1))
    drop[:, 0] = False
    sorted_probs.masked_fill_(drop, 0.0)
    sorted_probs.div_(sorted_probs.sum(dim=-1, keepdim=True))
    return torch.zeros_like(scaled).scatter_(1, order, sorted_probs)


def _sorted_prefix(
    scaled: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    full_lse: torch.Tensor | None,
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' stable descending order, or only a prefix of it that holds every kept token.

    NOTE: a full vocabulary sort is a large share of a CPU decode step (docs/model_runner.md).
    When every row keeps at most its top ``candidates`` tokens (a top-k within it, or a top-p
    reached within it), ``topk`` and a small sort give the same order for every token that can
    be kept. Tokens tied with the last candidate are included, and ``limit`` (how many tokens
    are >= that value) marks where the exact prefix ends.

    Returns:
        ``values [S, C]`` descending, ``order [S, C]`` their token ids, ``limit [S]``.
    """
    rows, vocab = scaled.shape
    width = min(vocab, candidates)
    if full_lse is None:  # every row has a top-k: no more than the largest k is needed
        width = min(width, int(top_k.max()))
    if width < vocab:
        top = scaled.topk(width, dim=-1)  # [S, width] descending
        resolved = top_k <= width
        if full_lse is not None:
            mass = (top.values - full_lse.unsqueeze(1)).exp().sum(dim=-1)  # [S]
            resolved = torch.where(top_k < vocab, resolved, top_p <= mass)
        if bool(resolved.all()):
            return _stable_topk(scaled, width, top)
    values, order = scaled.sort(dim=-1, descending=True, stable=True)
    return values, order, torch.full((rows,), vocab, device=scaled.device)


def _stable_topk(
    x: torch.Tensor, n: int, top: torch.return_types.topk | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At least the first ``n`` columns of ``x.sort(descending=True, stable=True)``, exactly.

    ``topk`` alone orders ties arbitrarily; here every token tied with the n-th is fetched and
    the few are sorted by id, then stably by value. ``limit [S]`` (>= n) is where each row's exact
    prefix ends; columns past it hold smaller values in no guaranteed order. ``top`` is
    ``x.topk(n)`` if the caller has it already.
    """
    top = x.topk(n, dim=-1) if top is None else top  # [S, n]
    limit = (x >= top.values[:, -1:]).sum(dim=-1)  # [S]
    widest = int(limit.max())
    ids = top.indices if widest == n else x.topk(widest, dim=-1).indices
    ids = ids.sort(dim=-1).values  # ascending ids, so that the stable sort breaks ties by id
    values, pos = x.gather(1, ids).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, pos), limit


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse CDF: the first token whose cumulative mass exceeds ``u``.

    ``u ~ U(0, 1)``, one per row, from the row's own generator (the default one when unseeded);
    zero-probability tokens never win, as the CDF is flat across them.
    """
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, dtype=torch.float64, generator=generator)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    target = u.to(probs.device).unsqueeze(1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # NOTE: rounding can put the target on the total (token == V); take the last kept token then.
    vocab = probs.shape[1]
    over = token >= vocab
    if bool(over.any()):
        token[over] = vocab - 1 - (probs[over].flip(dims=[1]) > 0).int().argmax(dim=-1)
    return token


def _logprobs(
    logits: torch.Tensor, tokens: Sequence[int], states: Sequence[RequestSamplingState]
) -> list[SampledLogprobs | None]:
    """Logprobs of the sampled tokens and the top-n, from ``log_softmax`` of the penalized logits."""
    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    result: list[SampledLogprobs | None] = [None] * len(states)
    if not wanted:
        return result
    if len(wanted) < len(states):
        logits = logits[torch.tensor(wanted, device=logits.device)]
    logprobs = logits.log_softmax(dim=-1)  # [W, V]
    picked = logprobs.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device))
    max_n = min(max(states[i].params.logprobs or 0 for i in wanted), logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if max_n > 0:  # NOTE: equal logprobs are listed in id order, so the top-n is deterministic
        values, ids, _ = _stable_topk(logprobs, max_n)
        top_values, top_ids = values[:, :max_n].tolist(), ids[:, :max_n].tolist()
    for j, i in enumerate(wanted):
        n = states[i].params.logprobs or 0
        result[i] = SampledLogprobs(
            sampled=TokenLogprob(tokens[i], float(picked[j, 0])),
            top=tuple(TokenLogprob(t, v) for t, v in zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
    return result


def _has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0 or params.frequency_penalty != 0


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(token_lists), V]`` float occurrence counts, via one scatter over padded id rows."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # pad = the spare column V
    real = torch.zeros(len(token_lists), width, dtype=torch.bool)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        real[row, : len(tokens)] = True
    if bool((real & ((ids < 0) | (ids >= vocab))).any()):
        raise ValueError(f"penalty token ids must be in [0, {vocab})")
    ids = ids.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]
