"""bench/mesh_sim.py on a small trace: the real scorer reaches the one-big-pool hit rate, round-robin
does not, and every request is served with its prefill counted once."""

from __future__ import annotations

from bench.mesh_sim import ideal_hit_rate, main, make_trace, simulate


def test_kv_aware_reaches_the_ideal_and_round_robin_misses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import argparse

    args = argparse.Namespace(requests_per_replica=40, prefix_len=128, output_len=8, blocks_per_replica=96,
                              prefill_ms_per_token=0.5, decode_ms_per_step=30.0)
    trace = make_trace(4, args, rate=20.0, seed=1)
    ideal = ideal_hit_rate(4, trace, args)
    rr, kv = simulate(4, "round_robin", trace, args), simulate(4, "kv_aware", trace, args)
    total = sum(len(r.tokens) for r in trace)
    for r in (rr, kv):  # every request prefilled exactly once: computed = prompt tokens x (1 - hit rate)
        assert round(r["prefill_tokens"]) == round(total * (1 - r["hit_rate"]))
    assert rr["imbalance_requests"] == 1.0  # 160 requests over 4 replicas in turn
    assert kv["hit_rate"] >= 0.85 * ideal and kv["hit_rate"] > rr["hit_rate"] + 0.05, (kv, rr, ideal)
    out = tmp_path / "mesh.md"
    assert main(["--replicas", "2", "--requests-per-replica", "10", "--prefix-len", "64", "--write", str(out)]) == 0
    table = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert [line.split(" | ")[1] for line in table] == ["round_robin", "kv_aware"]
