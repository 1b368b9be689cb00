"""bench/mesh.py's parts that need no processes: the seeded trace (groups, tenants, lengths) and
the report's target lines, computed from the rows it is given."""

from __future__ import annotations

import argparse

from bench.mesh import report, workload


def args(**kw: object) -> argparse.Namespace:
    base = dict(seed=3, groups=4, tenants=2, prefix_len=64, suffix_len=8, output_len=5, requests=40)
    return argparse.Namespace(**{**base, **kw})


def test_the_trace_is_seeded_and_groups_share_their_tenants_system_prompt() -> None:
    wl = workload(args(), vocab_size=384)
    assert wl == workload(args(), vocab_size=384) and wl != workload(args(seed=4), vocab_size=384)
    convs = wl.conversations
    assert [c.conversation_id for c in convs] == list(range(40))
    systems: dict[tuple[int, ...], set[str]] = {}
    for c in convs:
        (turn,) = c.turns
        prompt = turn.user_token_ids
        assert turn.output_len == 5 and 64 + 4 <= len(prompt) <= 64 + 12
        assert all(96 <= t < 384 for t in prompt)  # the low quarter (special tokens) is skipped
        systems.setdefault(prompt[:64], set()).add(c.cache_salt)
    assert len(systems) == 4  # one system prompt per group ...
    assert all(len(salts) == 1 for salts in systems.values())  # ... always with its tenant's salt
    assert sorted(s for salts in systems.values() for s in salts) == ["tenant-0", "tenant-0", "tenant-1", "tenant-1"]


def row(system: str, hit_rate: float, prefill: int, failed: int = 0) -> dict[str, object]:
    return {"system": system, "replicas": 1 if system == "ideal" else 2, "blocks_per_replica": 8,
            "hit_rate": hit_rate, "prefill_tokens": prefill, "prefill_tokens_per_replica": [prefill],
            "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "output_tok_s": 3.0, "requests_s": 4.0, "failed": failed,
            "all_blocks_free": True}


def test_the_report_judges_the_targets_from_the_rows() -> None:
    met = report([row("round_robin", 0.5, 3000), row("kv_aware", 0.86, 1000), row("ideal", 0.9, 900)], 0, args())
    assert "95.6% of the ideal's (>= 95%: met)" in met
    assert "3.00x fewer prefill tokens than round-robin (>= 3x: met)" in met
    assert "request by request: yes" in met
    missed = report([row("round_robin", 0.5, 2000), row("kv_aware", 0.8, 1000), row("ideal", 0.9, 900)], 2, args())
    assert "88.9% of the ideal's (>= 95%: NOT met)" in missed and "2.00x fewer" in missed
    assert "NO (2 of 40 differ)" in missed
