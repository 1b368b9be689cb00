"""Serving benchmark: the field's metrics (TTFT, TPOT, ITL, E2EL, goodput) for a running kvmesh.

Module map (one responsibility each):

    datasets.py    seeded synthetic workloads: random, shared-prefix, multi-turn (token ids)
    arrivals.py    when each conversation starts: all at once or Poisson at a rate
    transports.py  how one request is streamed: the public gRPC API, or the in-process engine
    driver.py      runs a workload through a transport with threads; per-request records
    metrics.py     per-request latencies, percentiles, goodput, the run's summary
    report.py      the ``vllm bench serve`` text block and the ``--save-result`` JSON
    plot.py        a PNG of latency percentiles and throughput over time
    run.py         ``kvmesh bench serve``: one benchmark against a running suite
    peers.py       transformers ``generate()`` (static cache) and ``generate_batch()`` as peers
    systems.py     the four compared systems behind one interface (open, measure, close)
    memory.py      KV slot occupancy and pool concurrency, sampled from an in-process engine
    machine.py     cores, memory, load averages and versions of the machine a run used
    compare.py     ``kvmesh bench compare``: every system on the same prompts, repeated, as ratios
    docs.py        renders the comparison into ``docs/benchmarks.md``
"""
