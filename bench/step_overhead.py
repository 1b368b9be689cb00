"""``python bench/step_overhead.py``: the Python-side cost of a model-runner step, outside the kernels.

    python bench/step_overhead.py                        # SmolLM2, decode at batch 1 and 32, a mixed step
    python bench/step_overhead.py --model tiny           # a tiny random llama: kernels ~free, overhead shows
    python bench/step_overhead.py --code /work/main      # the same measurement of another checkout's code
    python bench/step_overhead.py --rpc                  # plus one Execute over gRPC (localhost) per step

One process, one thread (``torch.set_num_threads(1)``). Every native kernel entry point
(``services/model_runner/native``'s ``NativeKernels``) is wrapped in a timer before the runner is
built, so a step splits into the time inside kvmesh's C kernels and the rest ("python": input
preparation, the torch ops between kernels, sampling, the runner's bookkeeping). The wrapper
itself costs ~0.3 us a call (2 calls a decode step, ~10 a layer on the per-layer path). Both wall
time and the thread's CPU time (``time.thread_time``) are split so: on a shared machine the CPU
time is the steadier figure (preemption by other processes is not in it).

Per ``--batches`` size: ``B`` prompts of ``--input-len`` random tokens are prefilled, then
``--steps`` decode steps of all ``B`` are timed (after 2 untimed ones). The mixed step: ``B - 1``
decodes plus one new request prefilling ``--chunk`` tokens (a fresh request each step, finished in
the next one). ``--rpc``: the same decode steps through ``ModelRunnerServicer`` on a localhost gRPC
server and ``RemoteRunner`` (the scheduler's client), reported as the client's wall time minus the
runner's own ``forward_seconds``: conversions, (de)serialization and the transport.

``--code DIR`` imports ``services`` from ``DIR`` (an A/B against another checkout: run both in
alternating processes). Prints one JSON object per line (``--json`` also writes them to a file).

``--ab BASE``: the whole native layer stack (``decode_stack.c``, every layer of a step in one call)
of commit ``BASE``'s kernels against this checkout's on decode-only steps, in one process (the
prefills run this checkout's build alone). Both are built
with the same flags (``bench/kernel_ab.py``'s builds); inside each timed decode step the two take
``--ab-turns`` turns each on the step's own inputs (the embeddings restored before every call; the
K/V they write are the same values at the same slots), timed in thread CPU time, and the step goes
on with this checkout's output. Reported: the medians of both and of their per-step ratio, and
whether every output was bitwise the same. Why: between processes this machine drifts by a few
percent in minutes, more than a change to one kernel moves a whole step.

``--screen-ab``: two runners of ``--dtype``, one with ``RunnerConfig.screen_head`` (greedy heads
screened, ``model/head_screen.py``) and one computing every logit, their decode steps taking turns
in one process (thread CPU time, medians and means after two turns each: a step the screen hands
to the full head is in the mean); reported with whether every sequence's tokens agree.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/kvmesh/SmolLM2-135M-Instruct"),
                   help="a checkpoint folder, or 'tiny' (a random 2-layer llama built here)")
    p.add_argument("--code", default=str(ROOT), help="checkout whose services/ is measured")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--chunk", type=int, default=16, help="prefill tokens of the mixed step (0: none)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="none", help="RunnerConfig.quantization (e.g. q4_1)")
    p.add_argument("--rpc", action="store_true")
    p.add_argument("--ab", default="", help="a commit: its decode stack against this checkout's, in one process")
    p.add_argument("--ab-turns", type=int, default=3, help="--ab: calls of each build per decode step")
    p.add_argument("--screen-ab", action="store_true",
                   help="two runners, RunnerConfig.screen_head on and off, their decode steps taking turns")
    p.add_argument("--json", default="")
    return p.parse_args()


NS = _parse()
sys.path.insert(0, NS.code)  # NOTE: before any kvmesh import: the code under test is --code's

import torch  # noqa: E402

from services.model_runner import native  # noqa: E402
from services.model_runner.config import RunnerConfig  # noqa: E402
from services.model_runner.factory import build_runner  # noqa: E402
from services.model_runner.runner import ModelRunner  # noqa: E402
from services.model_runner.types import CachedRequestData, NewRequestData, StepInput, StepOutput  # noqa: E402

BLOCK_SIZE = 16
NATIVE_SECONDS = [0.0, 0.0]  # wall and thread-CPU time inside native kernels since the last reset


def _time_native_kernels() -> None:
    """Wraps every entry point of the cached ``NativeKernels`` in a timer, in place (each spelling of
    the call is its own ``functools.cache`` entry, hence its own instance)."""
    done: set[int] = set()
    spellings = (native.load_kernels(), native.load_kernels(False), native.load_kernels(portable=False),
                 native.load_kernels(False, plain=False))  # the last: cpu_backend's
    for kernels in spellings:
        if kernels is None or id(kernels) in done:
            continue
        done.add(id(kernels))
        for field in dataclasses.fields(kernels):
            fn = getattr(kernels, field.name)
            if callable(fn):
                object.__setattr__(kernels, field.name, _timed(fn))


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            NATIVE_SECONDS[0] += time.perf_counter() - start
            NATIVE_SECONDS[1] += time.thread_time() - cpu

    return call


def _tiny_model() -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="kvmesh-tiny-")
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                               max_position_embeddings=2048)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


class Stepper:
    """A minimal scheduler: sequential block ids, decode steps, mixed steps."""

    def __init__(self, execute: Callable[[StepInput], StepOutput], vocab: int, batch: int):
        self.execute, self.vocab, self.batch = execute, vocab, batch
        self.next_block, self.step_id = 1, 0
        self.seqs: dict[str, list[Any]] = {}  # id -> [tokens, blocks, computed]
        self.gen = torch.Generator().manual_seed(0)
        self.pending_finish: list[str] = []

    def _blocks(self, seq: list[Any], tokens: int) -> tuple[int, ...]:
        need = -(-tokens // BLOCK_SIZE) - len(seq[1])
        new = tuple(range(self.next_block, self.next_block + need))
        self.next_block += need
        seq[1].extend(new)
        return new

    def _run(self, new: list[NewRequestData], cached: list[CachedRequestData], finished: list[str]) -> float:
        step = StepInput(self.step_id, tuple(new), tuple(cached), tuple(finished))
        self.step_id += 1
        start = time.perf_counter()
        out = self.execute(step)
        seconds = time.perf_counter() - start
        for token in out.sampled:
            if token.request_id in self.seqs:
                self.seqs[token.request_id][0].append(token.token_id)
        return seconds

    def _new(self, rid: str, length: int, keep: bool) -> NewRequestData:
        tokens = torch.randint(3, self.vocab, (length,), generator=self.gen).tolist()
        seq: list[Any] = [tokens, [], length]
        blocks = self._blocks(seq, length)
        if keep:
            self.seqs[rid] = seq
        else:
            self.pending_finish.append(rid)
        return NewRequestData(rid, tuple(tokens), length, blocks, 0, length)

    def prefill(self, length: int) -> None:
        for i in range(self.batch):
            self._run([self._new(f"s{i}", length, True)], [], [])

    def decode(self, rows: int | None = None, chunk: int = 0) -> float:
        cached = []
        for rid, seq in list(self.seqs.items())[: rows or self.batch]:
            new_blocks = self._blocks(seq, seq[2] + 1)
            cached.append(CachedRequestData(rid, new_blocks, seq[2], 1))
            seq[2] += 1
        finished, self.pending_finish = self.pending_finish, []
        new = [self._new(f"m{self.step_id}", chunk, False)] if chunk else []
        return self._run(new, cached, finished)


def _build(model: str, batch: int, blocks_per_seq: int, max_len: int, screen_head: bool = True) -> ModelRunner:
    from services.model_runner.kv_pool import bytes_per_block
    from services.model_runner.model.config import ModelConfig

    cfg = ModelConfig.from_dir(model)
    per_block = bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    blocks = batch * blocks_per_seq + (NS.steps + 2) * -(-NS.chunk // BLOCK_SIZE) + 2
    return build_runner(RunnerConfig(model_dir=model, device="cpu", num_threads=1, block_size=BLOCK_SIZE,
                                     kv_cache_memory_bytes=blocks * per_block, max_model_len=max_len,
                                     dtype=NS.dtype, quantization=NS.quantization,
                                     screen_head=screen_head))  # fmt: skip


def _timed_steps(fn: Callable[[], float]) -> dict[str, float]:
    """Medians of ``fn``'s steps: wall time, and this thread's CPU time (what other processes on a
    busy machine do not inflate; with one thread it is all the step's compute), each split into
    the native kernels' share and the rest."""
    for _ in range(2):
        fn()
    steps, natives, cpus, native_cpus = [], [], [], []
    for _ in range(NS.steps):
        NATIVE_SECONDS[:] = [0.0, 0.0]
        cpu = time.thread_time()
        steps.append(fn())
        cpus.append(time.thread_time() - cpu)
        natives.append(NATIVE_SECONDS[0])
        native_cpus.append(NATIVE_SECONDS[1])
    med = statistics.median
    return {"step_ms": med(steps) * 1e3, "native_ms": med(natives) * 1e3,
            "python_ms": med([s - n for s, n in zip(steps, natives, strict=True)]) * 1e3,
            "step_cpu_ms": med(cpus) * 1e3, "native_cpu_ms": med(native_cpus) * 1e3,
            "python_cpu_ms": med([s - n for s, n in zip(cpus, native_cpus, strict=True)]) * 1e3,
            "step_min_ms": min(steps) * 1e3}  # fmt: skip


def _rpc_overhead(runner: ModelRunner, stepper: Stepper) -> dict[str, float]:
    """Decode steps over gRPC: client wall minus the runner's own ``forward_seconds``."""
    from services.model_runner.client import RemoteRunner
    from services.model_runner.servicer import SERVICE, ModelRunnerServicer
    from shared.config import ServerConfig
    from shared.grpc_server import ServiceRegistration, start_server
    from shared.pb.kvmesh.v1 import model_runner_pb2_grpc

    running = start_server(ServerConfig(), [ServiceRegistration(
        SERVICE.grpc, ModelRunnerServicer(runner), model_runner_pb2_grpc.add_ModelRunnerServicer_to_server)])
    client = RemoteRunner(f"127.0.0.1:{running.port}")
    try:
        client.bind(runner.pool.generation)
        client._reset_next = False  # NOTE: the requests prefilled in-process stay known
        forward: list[float] = []

        def execute(step: StepInput) -> StepOutput:
            out = client.execute(step)
            forward.append(out.forward_seconds)
            return out

        stepper.execute = execute
        walls = [stepper.decode() for _ in range(NS.steps + 2)][2:]
        rpc = [w - f for w, f in zip(walls, forward[2:], strict=True)]
        return {"rpc_step_ms": statistics.median(walls) * 1e3, "rpc_overhead_ms": statistics.median(rpc) * 1e3}
    finally:
        client.close()
        running.server.stop(0)


class StackAB:
    """Stands in for a ``NativeDecodeStack``'s native call: each call runs the base build's and this
    checkout's ``kvmesh_decode_stack_f32`` in turns on the same inputs (see the module docstring)."""

    def __init__(self, libs: dict[str, Any], turns: int, bound: Any):
        self.fns = {name: lib.kvmesh_decode_stack_f32 for name, lib in libs.items()}
        for fn in self.fns.values():  # the signature as the loader binds it (native/__init__.py)
            fn.restype, fn.argtypes = bound.restype, bound.argtypes
        self.turns, self.calls = turns, 0
        self.seconds: dict[str, list[float]] = {name: [] for name in libs}
        self.ratios: list[float] = []
        self.bitwise = True

    def __call__(self, layers: Any, num_layers: int, shape: Any, step: Any) -> int:
        fields = step._obj
        if fields.num_chunks or fields.num_decodes != fields.tokens:
            # a prompt's chunk or a mixed step (the untimed prefills): this checkout's build alone, as a
            # base from before decode_stack.c took chunks would attend only the decode rows
            status: int = self.fns["new"](layers, num_layers, shape, step)
            return status
        hidden = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))[0]  # KvmStackShape starts with hidden
        n = fields.tokens * hidden
        x = torch.frombuffer((ctypes.c_float * n).from_address(fields.x), dtype=torch.float32)
        residual = torch.frombuffer((ctypes.c_float * n).from_address(fields.residual), dtype=torch.float32)
        x_in = x.clone()
        outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        times: dict[str, list[float]] = {name: [] for name in self.fns}
        order = list(self.fns) if self.calls % 2 == 0 else list(reversed(self.fns))
        for _ in range(self.turns):
            for name in order:
                x.copy_(x_in)
                start = time.thread_time()
                status = self.fns[name](layers, num_layers, shape, step)
                times[name].append(time.thread_time() - start)
                if status != 0:
                    raise RuntimeError(f"{name}: the decode stack failed with status {status}")
                outs[name] = (x.clone(), residual.clone())
        self.calls += 1
        self.bitwise &= all(torch.equal(a, b) for a, b in zip(outs["base"], outs["new"], strict=True))
        for name, ts in times.items():
            self.seconds[name].append(statistics.median(ts))
        self.ratios.append(self.seconds["new"][-1] / self.seconds["base"][-1])
        x.copy_(outs["new"][0])
        residual.copy_(outs["new"][1])
        return 0


def _install_ab(runner: ModelRunner, base: str, work: Path) -> StackAB:
    """Puts a :class:`StackAB` of ``base``'s build and this checkout's into the runner's decode stack."""
    sys.path.insert(0, str(ROOT))
    from bench.kernel_ab import builds

    stacks = [m.stack for m in runner.model.modules() if getattr(m, "stack", None) is not None]
    if not stacks:
        raise SystemExit("--ab: this model and mode run no native decode stack")
    stack: Any = stacks[0]
    ab = StackAB(builds(base, work), NS.ab_turns, stack._fn)
    stack._fn = ab
    return ab


def main() -> None:
    torch.set_num_threads(1)
    if NS.ab:
        _main_ab()
        return
    if NS.screen_ab:
        _main_screen_ab()
        return
    _time_native_kernels()
    model = _tiny_model() if NS.model == "tiny" else NS.model
    rows = []
    for batch in (int(b) for b in NS.batches.split(",")):
        max_len = NS.input_len + 3 * (NS.steps + 2) + 1
        runner = _build(model, batch, -(-max_len // BLOCK_SIZE), max_len)
        torch.set_num_threads(1)
        try:
            stepper = Stepper(runner.execute, runner.config.vocab_size, batch)
            stepper.prefill(NS.input_len)
            row: dict[str, Any] = {"code": NS.code, "model": Path(NS.model).name, "batch": batch,
                                   "dtype": runner.model_info().dtype, **_timed_steps(stepper.decode)}
            if NS.chunk and batch > 1:
                mixed = _timed_steps(partial(stepper.decode, batch - 1, NS.chunk))
                row.update({f"mixed_{k}": v for k, v in mixed.items()})
            if NS.rpc:
                row.update(_rpc_overhead(runner, stepper))
        finally:
            runner.pool.close()
        print(json.dumps(row), flush=True)
        rows.append(row)
    if NS.json:
        Path(NS.json).write_text("".join(json.dumps(r) + "\n" for r in rows))


def _main_ab() -> None:
    """``--ab``: per batch size, the decode steps' stack time of both builds and their ratio."""
    model = _tiny_model() if NS.model == "tiny" else NS.model
    for batch in (int(b) for b in NS.batches.split(",")):
        max_len = NS.input_len + NS.steps + 4
        runner = _build(model, batch, -(-max_len // BLOCK_SIZE), max_len)
        torch.set_num_threads(1)
        try:
            stepper = Stepper(runner.execute, runner.config.vocab_size, batch)
            stepper.prefill(NS.input_len)
            with tempfile.TemporaryDirectory(prefix="kvmesh-stack-ab-") as work:
                ab = _install_ab(runner, NS.ab, Path(work))
                for _ in range(NS.steps + 1):
                    stepper.decode()
            med = statistics.median
            skip = 1  # the first step warms both builds up
            print(json.dumps({"base": NS.ab, "batch": batch, "dtype": runner.model_info().dtype,
                              "steps": NS.steps, "turns": NS.ab_turns,
                              "base_ms": med(ab.seconds["base"][skip:]) * 1e3,
                              "new_ms": med(ab.seconds["new"][skip:]) * 1e3,
                              "new_over_base": med(ab.ratios[skip:]),
                              "ratio_min": min(ab.ratios[skip:]), "ratio_max": max(ab.ratios[skip:]),
                              "bitwise": ab.bitwise}), flush=True)  # fmt: skip
        finally:
            runner.pool.close()


def _main_screen_ab() -> None:
    """``--screen-ab``: per batch size, the decode steps of a runner whose greedy head is screened
    (``model/head_screen.py``) and of one computing every logit, taking turns in this process
    (thread CPU time; the same prompts, so the tokens must agree)."""
    model = _tiny_model() if NS.model == "tiny" else NS.model
    for batch in (int(b) for b in NS.batches.split(",")):
        max_len = NS.input_len + NS.steps + 4
        runners = {on: _build(model, batch, -(-max_len // BLOCK_SIZE), max_len, screen_head=on) for on in (True, False)}
        torch.set_num_threads(1)
        try:
            steppers = {on: Stepper(r.execute, r.config.vocab_size, batch) for on, r in runners.items()}
            seconds: dict[bool, list[float]] = {True: [], False: []}
            for stepper in steppers.values():
                stepper.prefill(NS.input_len)
            for step in range(NS.steps + 2):
                for on in (True, False) if step % 2 else (False, True):
                    start = time.thread_time()
                    steppers[on].decode()
                    if step >= 2:  # the first turns warm both up
                        seconds[on].append(time.thread_time() - start)
            on_ms, off_ms = (statistics.median(seconds[on]) * 1e3 for on in (True, False))
            on_mean, off_mean = (statistics.fmean(seconds[on]) * 1e3 for on in (True, False))
            same = all(steppers[True].seqs[r][0] == steppers[False].seqs[r][0] for r in steppers[True].seqs)
            print(json.dumps({"batch": batch, "dtype": runners[True].model_info().dtype, "steps": NS.steps,
                              "screened_ms": on_ms, "full_ms": off_ms, "screened_over_full": on_ms / off_ms,
                              "screened_mean_ms": on_mean, "full_mean_ms": off_mean,
                              "mean_screened_over_full": on_mean / off_mean,
                              "same_tokens": same}), flush=True)  # fmt: skip
        finally:
            for runner in runners.values():
                runner.pool.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
