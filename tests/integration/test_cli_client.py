"""``kvmesh generate`` / ``kvmesh chat`` / ``kvmesh up`` as a person types them: real processes,
answers checked against the Python client on the same suite, errors as one line without a traceback."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.scheduler.client import KVMeshClient
from services.suite import Suite, SuiteConfig


def _kvmesh(*args: str, stdin: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout, env={**os.environ, **(env or {})},
                          stdin=None if stdin is not None else subprocess.DEVNULL)


@pytest.fixture(scope="module")
def suite(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    env = {"KVMESH_RUNNER_BLOCK_SIZE": "4", "KVMESH_RUNNER_KV_CACHE_MEMORY_BYTES": str(64 * 2048),
           "KVMESH_RUNNER_WARMUP": "0"}
    s = Suite(SuiteConfig(model_dir=str(tiny_llama_dir), scheduler_port=0, with_offload=False,
                          log_dir=str(tmp_path_factory.mktemp("cli-suite")), extra_env=env))
    yield s
    s.stop()


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_connection_refused_is_one_line_and_exit_1() -> None:
    for cmd in (["generate", "hi"], ["chat"]):
        proc = _kvmesh(*cmd, "--address", _dead_address(), stdin="hello\n")
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith("kvmesh: error: UNAVAILABLE: "), line


def test_invalid_argument_is_one_line_naming_the_field(suite: Suite) -> None:
    proc = _kvmesh("generate", "hi", "--address", suite.address, "--top-p", "1.5")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("kvmesh: error: INVALID_ARGUMENT: sampling.top_p"), line


def test_generate_json_with_sampling_flags_matches_the_client(suite: Suite) -> None:
    args = ["--max-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "7",
            "--logprobs", "2"]
    proc = _kvmesh("generate", "The capital of France", "--address", suite.address, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    with KVMeshClient(suite.address) as client:
        text, ids, final = client.complete("The capital of France", 6, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                                           logprobs=2)
    assert got["text"] == text and got["token_ids"] == ids
    assert got["usage"]["completion_tokens"] == final.completion_tokens == len(ids)
    assert got["finish_reason"] in ("stop", "length")
    assert [lp["token_id"] for lp in got["logprobs"]] == ids and all(len(lp["top"]) == 2 for lp in got["logprobs"])


def test_generate_stop_string_ends_the_text_before_it(suite: Suite) -> None:
    with KVMeshClient(suite.address) as client:
        full, _, _ = client.complete("Paged attention", 12, ignore_eos=True)
    stop = full[3:5]
    assert stop
    proc = _kvmesh("generate", "Paged attention", "--address", suite.address, "--json", "--max-tokens", "12",
                   "--stop", stop)
    got = json.loads(proc.stdout)
    assert got["text"] == full[: full.index(stop)]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop


def test_chat_commands_system_reset_exit(suite: Suite) -> None:
    with KVMeshClient(suite.address) as client:
        with_system, _, _ = client.complete([("system", "Be brief."), ("user", "Hello")], 5)
        second_turn, _, _ = client.complete([("system", "Be brief."), ("user", "Hello"),
                                             ("assistant", with_system), ("user", "Again")], 5)
    script = "/system Be brief.\nHello\nAgain\n/reset\nHello\n/exit\nNever read\n"
    proc = _kvmesh("chat", "--address", suite.address, "--max-tokens", "5", stdin=script)
    assert proc.returncode == 0, proc.stderr
    answers = re.findall(r"assistant> (.*?)\n\[\d+ tokens", proc.stdout, re.S)
    # the first answer, the second turn with history, and after /reset the first answer again
    assert answers == [with_system, second_turn, with_system], proc.stdout
    assert "(conversation cleared)" in proc.stdout and proc.stdout.count("assistant> ") == 3


def test_up_refuses_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    proc = _kvmesh("up", "--model", str(tmp_path), "--port", "0", "--http-port", "-1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"kvmesh: error: --model {tmp_path}: not a checkpoint folder (no config.json)"


def test_up_honours_kvmesh_model_dir(tmp_path: Path) -> None:
    # With only the variable set, kvmesh up must use that folder (here: refuse it by name),
    # not silently prepare and serve the embedded model.
    (tmp_path / "config.json").write_text("{}")
    proc = _kvmesh("up", "--port", "0", "--http-port", "-1", env={"KVMESH_MODEL_DIR": str(tmp_path)}, timeout=30)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"kvmesh: error: KVMESH_MODEL_DIR {tmp_path}: not a checkpoint folder (no *.safetensors weights)"
