"""The OpenAI-compatible gateway as a real process in front of a real suite, driven by the real
``openai`` SDK and by plain ``httpx`` (for SSE framing and disconnects).

Greedy text through HTTP equals the gRPC path's; streamed chunks join to the same text; usage
and cached tokens are the scheduler's; a client that goes away frees its blocks; every error
status maps from the scheduler's gRPC status. Statuses the real scheduler cannot produce on
demand (401 before API keys exist, 429 on an exact request) come from a small scheduler stand-in
served over real gRPC, which also shows what metadata the gateway forwards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig
from shared.launcher import ServiceProcess
from shared.pb.kvmesh.v1 import kv_cache_manager_pb2, kv_cache_manager_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"  # the README's examples name the embedded model; the gateway is told to use it
BLOCK = 4
PROMPT_IDS = [5, 17, 33, 48, 90, 120, 7, 64, 200, 31, 11, 250, 42, 77, 300, 8, 9, 13, 21, 99, 150]  # 21 tokens


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {
        "KVMESH_RUNNER_BLOCK_SIZE": str(BLOCK),
        "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(96 * 2048),
        "KVMESH_RUNNER_WARMUP": "0",
        "KVMESH_GATEWAY_SERVED_MODEL_NAME": MODEL,
    }
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=False, gateway_port=0,
                          log_dir=str(tmp_path_factory.mktemp("gateway-suite")), extra_env=env))
    yield s
    s.stop()


def _base(suite: Suite) -> str:
    return f"http://{suite.services['gateway'].address}"


@pytest.fixture(scope="module")
def sdk(suite: Suite) -> openai.OpenAI:
    return openai.OpenAI(base_url=_base(suite) + "/v1", api_key="EMPTY", max_retries=0, timeout=60)


def _kv_stats(suite: Suite) -> kv_cache_manager_pb2.KVCacheStats:
    with grpc.insecure_channel(suite.services["kv-cache-manager"].address) as ch:
        return kv_cache_manager_pb2_grpc.KVCacheManagerStub(ch).GetStats(kv_cache_manager_pb2.GetStatsRequest())


def _wait_all_free(suite: Suite, timeout: float = 10.0) -> kv_cache_manager_pb2.KVCacheStats:
    deadline = time.monotonic() + timeout
    while True:
        stats = _kv_stats(suite)
        if stats.num_requests == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _salt() -> str:
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------- same answers


def test_completion_greedy_text_equals_the_grpc_path(suite: Suite, sdk: openai.OpenAI) -> None:
    salt = _salt()
    with KVMeshClient(suite.address) as client:
        text, ids, final = client.complete(PROMPT_IDS, 8, ignore_eos=True, cache_salt=salt)
        chat_text, _, _ = client.complete([("user", "The capital of France")], 6, ignore_eos=True)
    got = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True, "cache_salt": salt + "-http"})
    assert got.choices[0].text == text
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (21, 8, 29)
    assert len(ids) == 8 and final.completion_tokens == 8
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The capital of France"}],
                                       max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == chat_text
    assert chat.choices[0].message.role == "assistant"
    # text prompts go through the scheduler's tokenizer, as on the gRPC path
    with KVMeshClient(suite.address) as client:
        text2, _, _ = client.complete("The capital of France is", 5, ignore_eos=True)
    got2 = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert got2.choices[0].text == text2


def test_streamed_chunks_join_to_the_same_text_with_usage(suite: Suite, sdk: openai.OpenAI) -> None:
    whole = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=10, temperature=0,
                                   extra_body={"ignore_eos": True, "cache_salt": _salt()})
    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True, "cache_salt": _salt()}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (21, 10)
    assert all(c.usage is None for c in chunks[:-1])

    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    whole_chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                             extra_body={"ignore_eos": True})
    parts = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole_chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length"
    assert all(p.usage is None for p in parts)  # no include_usage: no usage chunk


def test_cached_tokens_are_reported(suite: Suite, sdk: openai.OpenAI) -> None:
    salt = _salt()
    first = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                   extra_body={"cache_salt": salt, "ignore_eos": True})
    second = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=2, temperature=0,
                                    extra_body={"cache_salt": salt, "ignore_eos": True})
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # 21 prompt tokens, blocks of 4, at most num_tokens - 1 reused: five full blocks
    assert second.usage.prompt_tokens_details.cached_tokens == 20
    assert second.choices[0].text == first.choices[0].text


def test_logprobs_name_the_sampled_tokens(suite: Suite, sdk: openai.OpenAI) -> None:
    with KVMeshClient(suite.address) as client:
        _, ids, _ = client.complete(PROMPT_IDS, 3, ignore_eos=True, logprobs=2)
        strings = [client.stub.Detokenize(scheduler_pb2.DetokenizeRequest(token_ids=[t])).text for t in ids]
    got = sdk.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=3, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens == strings
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [0, len(strings[0]), len(strings[0]) + len(strings[1])]
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: sampled = most likely


# ---------------------------------------------------------------------------------- framing


def test_sse_framing_and_request_id(suite: Suite) -> None:
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", _base(suite) + "/v1/completions", json=body, headers={"X-Request-Id": "req-42"},
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "req-42"
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert {p["id"] for p in payloads} == {"cmpl-req-42"}
    assert payloads[-1]["usage"]["completion_tokens"] == 4
    r2 = httpx.post(_base(suite) + "/v1/completions", json={**body, "stream": False}, timeout=60,
                    headers={"X-Request-Id": "req-43"})
    assert r2.headers["x-request-id"] == "req-43" and r2.json()["id"] == "cmpl-req-43"
    r3 = httpx.post(_base(suite) + "/v1/completions", json={**body, "stream": False}, timeout=60)
    assert r3.json()["id"] == f"cmpl-{r3.headers['x-request-id']}"


def test_models_health_version_tokenize_detokenize(suite: Suite, sdk: openai.OpenAI, tiny_llama_dir: Path) -> None:
    assert [m.id for m in sdk.models.list()] == [MODEL]
    base = _base(suite)
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/version").json()["version"]
    with KVMeshClient(suite.address) as client:
        ids = client.tokenize("Hello world")
    tok = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tok["tokens"] == ids and tok["count"] == len(ids) and tok["max_model_len"] == 512
    assert httpx.post(base + "/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": "Hello world"}
    metrics = httpx.get(base + "/metrics").text
    # the label is the deployment's one model_name (the folder name), as on every other service
    label = tiny_llama_dir.name
    assert re.search(rf'kvmesh:http_requests_total{{model_name="{label}",route="/tokenize",status="200"}} 1\.0',
                     metrics), metrics[-2000:]


# ------------------------------------------------------------------------------ cancellation


def test_client_disconnect_frees_blocks(suite: Suite) -> None:
    # NOTE: 350 tokens take the tiny model seconds; freed well within a second means the call was
    # cancelled, not run to its end.
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 350, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", _base(suite) + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _kv_stats(suite).num_requests == 1
    # the connection is closed here, ~350 tokens from done
    gone = time.monotonic()
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
    assert time.monotonic() - gone < 1.0

    # non-streaming: the client gives up waiting; the gateway notices and cancels the call
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(_base(suite) + "/v1/completions", json={**body, "stream": False},
                   timeout=httpx.Timeout(60, read=0.3))
    gone = time.monotonic()
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks
    assert time.monotonic() - gone < 1.0


# ------------------------------------------------------------------------------------ errors


def _error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err: dict[str, Any] = body["error"]
    return err


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": 100000}, "max_tokens"),      # the scheduler's INVALID_ARGUMENT
    ({"top_p": 1.5}, "top_p"),                  # the scheduler's sampling validation
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"max_tokens": "many"}, "max_tokens"),     # the body's own validation
])
def test_bad_requests_are_400_naming_the_param(suite: Suite, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **extra}
    r = httpx.post(_base(suite) + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"]
    assert _wait_all_free(suite).num_requests == 0


def test_error_statuses_through_the_sdk(suite: Suite, sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        sdk.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2)
    assert bad.value.param == "n"
    with pytest.raises(openai.BadRequestError) as tools:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert tools.value.param == "tools"


def test_deadline_is_504_and_frees_blocks(suite: Suite, tmp_path: Path) -> None:
    env = {"KVMESH_GATEWAY_SCHEDULER_ADDRESS": suite.address, "KVMESH_GATEWAY_REQUEST_TIMEOUT_SECONDS": "0.3",
           "KVMESH_GATEWAY_SERVED_MODEL_NAME": MODEL}
    with ServiceProcess("gateway", env=env, log_dir=str(tmp_path), startup_timeout=60) as gw:
        body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 300, "ignore_eos": True}
        r = httpx.post(f"http://{gw.address}/v1/completions", json=body, timeout=30)
        assert r.status_code == 504, r.text
        assert _error(r)["code"] == "deadline_exceeded"
    stats = _wait_all_free(suite)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_blocks


def test_scheduler_down_is_503(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    env = {"KVMESH_GATEWAY_SCHEDULER_ADDRESS": dead, "KVMESH_GATEWAY_SERVED_MODEL_NAME": MODEL}
    # /health is 503 by design here, so wait for the port file, not for health
    with _raw_gateway(env, tmp_path) as base:
        assert httpx.get(base + "/health", timeout=10).status_code == 503
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert _error(r)["type"] == "service_unavailable"


class _Raw:
    def __init__(self, env: dict[str, str], folder: Path) -> None:
        import os

        port_file = folder / "gw.port"
        self.proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "gateway"], env={
            **os.environ, **env, "KVMESH_HOST": "127.0.0.1", "KVMESH_PORT": "0", "KVMESH_PORT_FILE": str(port_file)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{port_file.read_text()}"

    def __enter__(self) -> str:
        return self.base

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _raw_gateway(env: dict[str, str], folder: Path) -> _Raw:
    return _Raw(env, folder)


class _StandIn(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler stand-in over real gRPC: answers by the prompt text, records the metadata."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    def GetModelInfo(self, request: Any, context: grpc.ServicerContext) -> scheduler_pb2.SchedulerModelInfo:
        return scheduler_pb2.SchedulerModelInfo(model_id="stand-in", vocab_size=100, max_model_len=64, block_size=4,
                                                num_blocks=32, max_logprobs=5, has_chat_template=True)

    def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[scheduler_pb2.GenerateResponse]:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.metadata.append(md)
        if md.get("authorization") != "Bearer sk-good":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or unknown API key")
        if request.text == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the waiting queue is full (1024 requests)")
        if request.text == "gone":
            context.abort(grpc.StatusCode.UNAVAILABLE, "model-runner unavailable")
        yield scheduler_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1], text="ok")
        final = scheduler_pb2.GenerateFinal(finish_reason=scheduler_pb2.FINISH_REASON_STOP, prompt_tokens=1,
                                            completion_tokens=1, cached_tokens=0)
        yield scheduler_pb2.GenerateResponse(request_id=request.request_id, final=final)


@pytest.fixture()
def stand_in(tmp_path: Path) -> Iterator[tuple[_StandIn, str]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    servicer = _StandIn()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"KVMESH_GATEWAY_SCHEDULER_ADDRESS": f"127.0.0.1:{port}", "KVMESH_GATEWAY_RETRY_AFTER_SECONDS": "7"}
    try:
        with _raw_gateway(env, tmp_path) as base:
            yield servicer, base
    finally:
        server.stop(0)


def test_auth_is_forwarded_and_statuses_map(stand_in: tuple[_StandIn, str]) -> None:
    servicer, base = stand_in
    good = openai.OpenAI(base_url=base + "/v1", api_key="sk-good", max_retries=0)
    bad = openai.OpenAI(base_url=base + "/v1", api_key="sk-bad", max_retries=0)
    ok = good.completions.create(model="stand-in", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "r-1"})
    assert ok.choices[0].text == "ok" and ok.id == "cmpl-r-1"
    assert servicer.metadata[-1]["authorization"] == "Bearer sk-good"
    assert servicer.metadata[-1]["x-request-id"] == "r-1"
    with pytest.raises(openai.AuthenticationError) as auth:
        bad.completions.create(model="stand-in", prompt="hi", max_tokens=2)
    assert auth.value.status_code == 401 and "API key" in auth.value.message
    with pytest.raises(openai.RateLimitError) as busy:
        good.completions.create(model="stand-in", prompt="busy", max_tokens=2)
    assert busy.value.response.headers["retry-after"] == "7"
    gone = {"model": "stand-in", "prompt": "gone", "max_tokens": 2, "stream": True}
    r = httpx.post(base + "/v1/completions", json=gone,
                   headers={"Authorization": "Bearer sk-good"})
    assert r.status_code == 503 and _error(r)["code"] == "unavailable"


# ----------------------------------------------------------------------------------- README


def _readme_block(lang: str, must_contain: str) -> str:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## OpenAI-compatible HTTP API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{lang}\n(.*?)```", section, re.S)
    found = [b for b in blocks if must_contain in b]
    assert len(found) == 1, blocks
    return found[0]


def test_readme_examples_run_verbatim(suite: Suite) -> None:
    address = suite.services["gateway"].address
    curl = _readme_block("bash", "curl").replace("127.0.0.1:8000", address)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60, check=True).stdout
    answer = json.loads(out)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] >= 1
    code = _readme_block("python", "from openai import OpenAI").replace("127.0.0.1:8000", address)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(answer["choices"][0]["message"]["content"])
    assert re.search(r"\n \d+ cached prompt tokens\n$", run.stdout), run.stdout


# ----------------------------------------------------------------------------------- bench


def test_bench_serve_openai_backend_matches_grpc(suite: Suite, tmp_path: Path) -> None:
    common = ["bench", "serve", "--dataset", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "6",
              "--seed", "3", "--no-progress"]
    results = {}
    for backend, where in (("openai", ["--base-url", _base(suite)]), ("grpc", ["--address", suite.address])):
        out = tmp_path / f"{backend}.json"
        proc = subprocess.run([sys.executable, "-m", "services.cli", *common, "--backend", backend, *where,
                               "--save-result", str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "Serving Benchmark Result" in proc.stdout
        results[backend] = json.loads(out.read_text())
    http, rpc = results["openai"], results["grpc"]
    assert http["backend"] == "openai" and rpc["backend"] == "grpc"
    assert http["completed"] == rpc["completed"] == 4 and http["errors"] == [""] * 4
    assert http["output_lens"] == rpc["output_lens"] == [6] * 4
    assert http["input_lens"] == rpc["input_lens"]
    # the same greedy tokens through both doors
    by_conv = {b: sorted((r["conversation_id"], r["output_token_ids"]) for r in res["requests"])
               for b, res in results.items()}
    assert by_conv["openai"] == by_conv["grpc"]
    assert len(http["itls"]) == 4 and all(len(g) == 5 for g in http["itls"])
