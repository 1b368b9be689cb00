"""The engines of one run (the rows of the table): what runs, in which venv, with which settings.

kvmesh runs twice per transport: with explicit exact settings (``float32`` + the native ``cpu``
kernels + ``quantization=none``: dense fp32 weights, the bytes vLLM's fp32 reads, the mode the
parity tests pin and the identity reference) and with ``auto`` (whatever the runner picks on this
machine with nothing set, ``quantization`` included; the row shows what it resolved). vLLM runs in fp32 and in its
own default dtype (the baseline of the ratios, as a user would run it). llama.cpp runs an F32 GGUF
converted from the same HF folder (with f32 KV, so it is an fp32 row end to end) and the Q4_1 GGUF
the model ships as (llama.cpp's defaults: f16 KV).

The HTTP rows put both servers behind one client: ``vllm serve`` (vLLM's OpenAI-compatible server,
same folder, same dtype) and kvmesh's gateway (``kvmesh up`` with its HTTP front door), each
driven by the driver of ``kvmesh bench serve --backend openai`` (``worker_openai.py``).

Memory: an engine that runs in its worker's process (vLLM offline, whose engine core is a child;
llama.cpp; kvmesh in-process) counts the worker's whole process tree; a server the worker starts
and only drives (``count_worker=False``: the kvmesh suite, both HTTP servers) counts the server's
processes, not the worker's own client and driver.

The ``int8`` and ``q4_1`` rows (opt-in, not in ``all``'s default story) run kvmesh with
``quantization=int8_weight_only`` / ``q4_1``, for the single-stream target.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class EngineSpec:
    """One row: a name, a label, which worker runs it, and its settings."""

    name: str
    label: str
    kind: str  # "vllm", "llamacpp", "kvmesh" or "openai": which worker (and which venv runs it)
    settings: Mapping[str, Any] = field(default_factory=dict)
    count_worker: bool = True  # memory: the worker's process counts (False: only the server it starts)

    @property
    def worker(self) -> Path:
        """The worker script for this kind."""
        return HERE / f"worker_{self.kind}.py"


ENGINES = (
    EngineSpec("vllm-fp32", "vLLM CPU fp32", "vllm", {"dtype": "float32"}),
    EngineSpec("vllm-default", "vLLM CPU default dtype", "vllm", {"dtype": "auto"}),
    EngineSpec("llamacpp-f32", "llama.cpp F32", "llamacpp", {"gguf": "f32", "kv_type": "f32"}),
    EngineSpec("llamacpp-q4_1", "llama.cpp Q4_1", "llamacpp", {"gguf": "q4_1", "kv_type": "f16"}),
    EngineSpec("kvmesh-suite-fp32", "kvmesh suite fp32+cpu", "kvmesh",
               {"mode": "suite", "dtype": "float32", "attention_backend": "cpu", "quantization": "none"},
               count_worker=False),
    EngineSpec("kvmesh-suite-auto", "kvmesh suite auto", "kvmesh",
               {"mode": "suite", "dtype": "auto", "attention_backend": "auto"}, count_worker=False),
    EngineSpec("kvmesh-inproc-fp32", "kvmesh in-process fp32+cpu", "kvmesh",
               {"mode": "inprocess", "dtype": "float32", "attention_backend": "cpu", "quantization": "none"}),
    EngineSpec("kvmesh-inproc-auto", "kvmesh in-process auto", "kvmesh",
               {"mode": "inprocess", "dtype": "auto", "attention_backend": "auto"}),
    EngineSpec("vllm-serve-fp32", "vllm serve fp32 (HTTP)", "openai", {"server": "vllm", "dtype": "float32"},
               count_worker=False),
    EngineSpec("vllm-serve-default", "vllm serve default dtype (HTTP)", "openai", {"server": "vllm", "dtype": "auto"},
               count_worker=False),
    EngineSpec("kvmesh-http-fp32", "kvmesh gateway fp32+cpu (HTTP)", "openai",
               {"server": "kvmesh", "dtype": "float32", "attention_backend": "cpu",
                "quantization": "none"}, count_worker=False),
    EngineSpec("kvmesh-http-auto", "kvmesh gateway auto (HTTP)", "openai",
               {"server": "kvmesh", "dtype": "auto", "attention_backend": "auto"}, count_worker=False),
    EngineSpec("kvmesh-suite-int8", "kvmesh suite int8 weights", "kvmesh",
               {"mode": "suite", "dtype": "auto", "attention_backend": "auto", "quantization": "int8_weight_only"},
               count_worker=False),
    EngineSpec("kvmesh-inproc-int8", "kvmesh in-process int8 weights", "kvmesh",
               {"mode": "inprocess", "dtype": "auto", "attention_backend": "auto",
                "quantization": "int8_weight_only"}),
    EngineSpec("kvmesh-suite-q4_1", "kvmesh suite Q4_1 weights", "kvmesh",
               {"mode": "suite", "dtype": "auto", "attention_backend": "auto", "quantization": "q4_1"},
               count_worker=False),
    EngineSpec("kvmesh-inproc-q4_1", "kvmesh in-process Q4_1 weights", "kvmesh",
               {"mode": "inprocess", "dtype": "auto", "attention_backend": "auto", "quantization": "q4_1"}),
)
BY_NAME = {e.name: e for e in ENGINES}
BASELINE = "vllm-default"  # ratios: against vLLM as a user runs it
FP32_BASELINE = "vllm-fp32"
REFERENCES = ("kvmesh-suite-fp32", "kvmesh-inproc-fp32")  # identity: kvmesh's exact mode, first that ran
DEFAULT_KVMESH = "kvmesh-suite-auto"  # the "default kvmesh suite"
EXACT_KVMESH = "kvmesh-suite-fp32"
LLAMA = ("llamacpp-f32", "llamacpp-q4_1")
WEIGHT_ONLY_KVMESH = ("kvmesh-suite-int8", "kvmesh-suite-q4_1")  # opt-in quantized rows: the single-stream target
HTTP_PAIRS = (("kvmesh-http-auto", "vllm-serve-default"), ("kvmesh-http-fp32", "vllm-serve-fp32"))  # same client


def select(names: str) -> tuple[EngineSpec, ...]:
    """Engines from a comma list (``all`` = every one), in ``ENGINES`` order."""
    if names in ("", "all"):
        return ENGINES
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}")
    return tuple(e for e in ENGINES if e.name in wanted)


def reference(ran: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The identity reference: the first of ``REFERENCES`` that ran and reported float32."""
    for name in REFERENCES:
        r = ran.get(name, {})
        if r.get("ok") and r.get("resolved", {}).get("dtype") == "float32":
            return name
    return None
