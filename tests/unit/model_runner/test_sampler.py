"""The sampler: exact behaviour on hand-built logits, penalties, seeds and logprobs."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from services.model_runner.sampler import (
    RequestSamplingState,
    apply_penalties,
    filtered_probs,
    greedy_tokens,
    sample,
)
from shared.sampling_params import SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05 as logits
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([PROBS]).log()


def state(prompt: tuple[int, ...] = (), output: tuple[int, ...] = (), **params: object) -> RequestSamplingState:
    return RequestSamplingState.create(SamplingParams(**params), prompt, output)  # type: ignore[arg-type]


def draw(logits: torch.Tensor, st: RequestSamplingState, times: int) -> Counter[int]:
    """``times`` tokens from one request, one step after another (same logits every step)."""
    return Counter(sample(logits, [st])[0][0] for _ in range(times))


def run_steps(step_logits: list[torch.Tensor], batch: list[RequestSamplingState], track: int) -> list[int]:
    """Samples ``len(step_logits)`` steps for a batch; row ``i`` gets ``step_logits[s][i]``."""
    tokens = []
    for logits in step_logits:
        out = sample(logits, batch)
        for row, st in enumerate(batch):
            st.output_token_ids.append(out[row][0])
        tokens.append(out[track][0])
    return tokens


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_tie_goes_to_the_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    assert [t for t, _ in sample(logits, [state(), state()])] == [1, 0]


def test_greedy_is_exactly_argmax_and_leaves_logits_untouched() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    tokens = [t for t, _ in sample(logits, [state() for _ in range(8)])]
    assert tokens == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("case", ["random", "ties", "nan", "inf", "non_contiguous"])
def test_greedy_tokens_equal_torch_argmax(case: str) -> None:
    # the numpy argmax of CPU fp32 rows must be torch's argmax exactly: first maximum, NaN largest
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(33, 4099, generator=gen)
    if case == "ties":
        logits = logits.round()
    if case in ("nan", "inf"):
        logits[torch.rand(logits.shape, generator=gen) < 0.001] = float(case)
        logits[3] = float(case)  # a whole row of it
        logits[4, 7], logits[4, 9] = float(case), float(case)
    if case == "non_contiguous":
        logits = logits.t().contiguous().t()
    with torch.inference_mode():
        tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, logits.argmax(dim=-1))
    edge = torch.tensor([[0.0, -0.0, 0.0], [-float("inf")] * 3, [1.0, float("inf"), float("nan")],
                         [float("nan"), 2.0, float("nan")]])  # fmt: skip
    assert greedy_tokens(edge).tolist() == edge.argmax(dim=-1).tolist() == [0, 0, 2, 0]


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    batch = [state(temperature=1.5, top_k=1, seed=s) for s in range(6)]
    assert [t for t, _ in sample(logits, batch)] == logits.argmax(dim=-1).tolist()


def test_temperature_to_zero_tends_to_argmax() -> None:
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(2))
    for temperature in (1e-3, 1e-30):
        batch = [state(temperature=temperature, seed=s) for s in range(16)]
        assert [t for t, _ in sample(logits, batch)] == logits.argmax(dim=-1).tolist()


# --- filters ------------------------------------------------------------------------------------


def test_filtered_probs_exact() -> None:
    def probs(**params: object) -> list[float]:
        return filtered_probs(LOGITS, [SamplingParams(**params)])[0].tolist()  # type: ignore[arg-type]

    assert probs(temperature=1.0) == pytest.approx(PROBS)
    assert probs(temperature=1.0, top_k=2) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # mass before token 2 is 0.8 >= 0.75: tokens 0 and 1 remain
    assert probs(temperature=1.0, top_p=0.75) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert probs(temperature=1.0, top_p=0.4) == pytest.approx([1.0, 0, 0, 0])  # top token always kept
    # min_p 0.25 * p_max 0.5 = 0.125: 0.15 stays, 0.05 goes
    assert probs(temperature=1.0, min_p=0.25) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    # temperature 2 takes square roots before renormalizing
    roots = [math.sqrt(p) for p in PROBS]
    assert probs(temperature=2.0) == pytest.approx([r / sum(roots) for r in roots])
    # top-p is applied to the top-k renormalized distribution: 0.625 < 0.7 keeps token 1 too
    assert probs(temperature=1.0, top_k=2, top_p=0.6) == pytest.approx([1.0, 0, 0, 0])
    assert probs(temperature=1.0, top_k=2, top_p=0.7) == pytest.approx([0.625, 0.375, 0, 0])


@pytest.mark.parametrize(
    ("params", "support"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.75}, {0, 1}),
        ({"min_p": 0.25}, {0, 1, 2}),
        ({"top_k": 3, "min_p": 0.5}, {0, 1}),
        ({}, {0, 1, 2, 3}),
    ],
)
def test_sampled_support(params: dict[str, Any], support: set[int]) -> None:
    counts = draw(LOGITS, state(temperature=1.0, seed=123, **params), 600)
    assert set(counts) == support


def test_frequencies_follow_the_distribution() -> None:
    torch.manual_seed(0)  # unseeded rows draw from the default generator
    n = 8000
    tokens = [t for t, _ in sample(LOGITS.expand(n, 4), [state(temperature=1.0) for _ in range(n)])]
    counts = Counter(tokens)
    for token, p in enumerate(PROBS):
        assert counts[token] / n == pytest.approx(p, abs=0.02)


# --- penalties ----------------------------------------------------------------------------------


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    st = state(prompt=(0,), output=(1, 1), repetition_penalty=2.0)
    # prompt and output tokens: positive halved, negative doubled; others untouched
    assert apply_penalties(logits, [st]).tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    st = state(prompt=(0, 3), output=(1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25)
    expected = [2.0, -1.0 - 0.5 - 2 * 0.25, 0.5 - 0.5 - 0.25, 3.0]
    assert apply_penalties(logits, [st]).tolist() == [pytest.approx(expected)]


def test_repetition_then_additive_penalties_per_row() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]]).repeat(3, 1)
    batch = [
        state(output=(3,)),  # no penalties: untouched
        state(prompt=(1,), output=(3, 3), repetition_penalty=1.5, frequency_penalty=1.0),
        state(output=(0,), presence_penalty=-1.0),  # a negative penalty encourages repeats
    ]
    out = apply_penalties(logits, batch)
    assert out[0].tolist() == [2.0, -1.0, 0.5, 3.0]
    assert out[1].tolist() == pytest.approx([2.0, -1.5, 0.5, 3.0 / 1.5 - 2.0])
    assert out[2].tolist() == [3.0, -1.0, 0.5, 3.0]


def test_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9]])
    assert sample(logits, [state(output=(0,))])[0][0] == 0
    assert sample(logits, [state(output=(0,), presence_penalty=0.5)])[0][0] == 1
    assert sample(logits, [state(prompt=(0,), repetition_penalty=1.1)])[0][0] == 1


def test_penalty_token_outside_the_vocabulary_is_rejected() -> None:
    with pytest.raises(ValueError, match="penalty token ids"):
        sample(torch.zeros(1, 4), [state(output=(4,), frequency_penalty=1.0)])


# --- seeds --------------------------------------------------------------------------------------


def test_seed_reproducible_across_batch_composition_and_row_order() -> None:
    gen = torch.Generator().manual_seed(5)
    own = [torch.randn(1, 64, generator=gen) for _ in range(6)]  # the tracked request's logits
    others = [torch.randn(3, 64, generator=gen) for _ in range(6)]

    def params() -> dict[str, Any]:
        return {"temperature": 0.9, "top_p": 0.95, "frequency_penalty": 0.3, "seed": 42}

    alone = run_steps(own, [state(**params())], track=0)
    batch = [state(temperature=1.0), state(**params()), state(temperature=1.0, seed=7), state()]
    mixed = run_steps([torch.cat([o[:1], m, o[1:]]) for m, o in zip(own, others, strict=True)], batch, 1)
    batch = [state(temperature=0.5, seed=9), state(temperature=1.0), state(**params())]
    reordered = run_steps([torch.cat([o[:2], m]) for m, o in zip(own, others, strict=True)], batch, 2)
    assert alone == mixed == reordered


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    logits = torch.zeros(1, 1000)  # uniform

    def tokens(seed: int) -> list[int]:
        st = state(temperature=1.0, seed=seed)
        return [sample(logits, [st])[0][0] for _ in range(10)]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)
    assert state(temperature=1.0, seed=2**64 - 1).generator is not None


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_match_log_softmax_of_penalized_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.5]])
    st = state(output=(3,), presence_penalty=1.0, temperature=0.3, top_k=1, seed=0, logprobs=3)
    token, lp = sample(logits, [st])[0]
    expected = torch.tensor([[2.0, -1.0, 0.5, 2.0, 0.5]]).log_softmax(dim=-1)[0]
    assert lp is not None
    assert token == 0  # 2.0 ties 2.0 (penalized 3.0); top-k 1 keeps the lowest id
    assert lp.sampled.token_id == 0 and lp.sampled.logprob == pytest.approx(float(expected[0]))
    # descending, ties by id; values are not affected by temperature or top-k
    assert [t.token_id for t in lp.top] == [0, 3, 2]
    assert [t.logprob for t in lp.top] == pytest.approx(expected[[0, 3, 2]].tolist())


def test_logprobs_counts_and_normalization() -> None:
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    batch = [state(logprobs=4), state(logprobs=0, temperature=1.0), state()]
    out = sample(logits, batch)
    full, only_sampled, none = (lp for _, lp in out)
    assert full is not None and only_sampled is not None and none is None
    assert sum(math.exp(t.logprob) for t in full.top) == pytest.approx(1.0)
    assert [t.logprob for t in full.top] == sorted((t.logprob for t in full.top), reverse=True)
    assert only_sampled.top == ()
    assert only_sampled.sampled.logprob == pytest.approx(float(logits[1].log_softmax(-1)[out[1][0]]))


# --- interface ----------------------------------------------------------------------------------


def test_shape_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 4), [state()])
    assert sample(torch.zeros(0, 4), []) == []


def test_create_copies_token_lists_and_seeds_only_when_asked() -> None:
    prompt = [1, 2]
    st = RequestSamplingState.create(SamplingParams(seed=3), prompt)
    prompt.append(3)
    assert st.prompt_token_ids == [1, 2] and st.output_token_ids == []
    assert st.generator is not None and state().generator is None


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """A plain-Python statement of the filters, to check the vectorized (and shortcut) version."""
    weights = [math.exp((x - max(logits)) / p.temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: (-weights[i], i))
    if 0 < p.top_k < len(logits):
        order = order[: p.top_k]
    total = sum(weights[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= p.top_p and p.top_p < 1.0:
            break
        kept.append(i)
        mass += weights[i] / total
    kept = [i for i in kept if weights[i] >= p.min_p * weights[order[0]]]
    out = [0.0] * len(logits)
    for i in kept:
        out[i] = weights[i] / sum(weights[j] for j in kept)
    return out


def test_filters_match_the_reference_with_and_without_the_sort_shortcut() -> None:
    gen = torch.Generator().manual_seed(11)
    vocab, rows = 12, 40
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # many ties
    picks = torch.rand(rows, 4, generator=gen).tolist()
    params = [
        SamplingParams(
            temperature=0.5 + a,
            top_k=[0, 1, 2, 5, 20][int(b * 5)],
            top_p=[1.0, 0.9, 0.5, 0.2][int(c * 4)],
            min_p=[0.0, 0.0, 0.3][int(d * 3)],
        )
        for a, b, c, d in picks
    ]
    expected = [reference_probs(row, p) for row, p in zip(logits.tolist(), params, strict=True)]
    for candidates in (1, 2, 5, vocab):  # small values take the shortcut for some batches
        for start in range(0, rows, 4):  # batches of 4: some all-resolved, some falling back
            got = filtered_probs(logits[start : start + 4], params[start : start + 4], candidates)
            assert got.tolist() == [pytest.approx(e, abs=1e-6) for e in expected[start : start + 4]]


def test_a_row_gets_the_same_probabilities_whichever_sort_path_its_batch_takes() -> None:
    gen = torch.Generator().manual_seed(12)
    row = torch.randn(1, 300, generator=gen) * 4
    flat = torch.zeros(1, 300)  # top-p 0.9 of a flat row needs 270 tokens: forces the full sort
    mine = SamplingParams(temperature=0.7, top_p=0.8)
    alone = filtered_probs(row, [mine], candidates=64)  # takes the shortcut
    together = filtered_probs(torch.cat([flat, row]), [SamplingParams(temperature=1.0, top_p=0.9), mine], 64)
    assert torch.equal(alone[0], together[1])


def test_top_logprobs_list_ties_in_id_order() -> None:
    logits = torch.zeros(1, 3000)
    logits[0, 2500] = 1.0
    _, lp = sample(logits, [state(logprobs=3)])[0]
    assert lp is not None
    assert [t.token_id for t in lp.top] == [2500, 0, 1]
