"""``kvmesh generate`` and ``kvmesh chat``: the public gRPC API from a terminal.

A failed call prints one line (``kvmesh: error: UNAVAILABLE: ...``) and exits 1: a person who
mistyped an address or a parameter needs the status and the server's message, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

import grpc

from services.scheduler.client import DEFAULT_ADDRESS, KVMeshClient
from shared.tls import TLSFiles

_FINISH = {0: "unspecified", 1: "stop", 2: "length", 3: "abort"}
CHAT_HELP = "commands: /system TEXT (set the system prompt and start over), /reset (forget the conversation), /exit"


def rpc_error_line(exc: grpc.RpcError) -> str:
    """One line for a failed call: status name and the server's (or gRPC's) message."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    name = code.name if code is not None else "ERROR"
    return f"kvmesh: error: {name}: {(details or '').splitlines()[0] if details else name}"


def _one_line_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        try:
            return fn(ns)
        except grpc.RpcError as exc:
            print(rpc_error_line(exc), file=sys.stderr, flush=True)
            return 1

    return run


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    return {"temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k, "seed": ns.seed,
            "stop": ns.stop or (), "logprobs": getattr(ns, "logprobs", None)}


def _client(ns: argparse.Namespace) -> KVMeshClient:
    """A client with the command's API key and TLS settings."""
    tls = TLSFiles(ca=ns.tls_ca, server_name=ns.tls_server_name) if ns.tls_ca else None
    return KVMeshClient(ns.address, api_key=ns.api_key or None, tls=tls)


def _stats_line(final: Any) -> str:
    t = final.timing
    busy = t.e2e_seconds - t.ttft_seconds
    rate = (final.completion_tokens - 1) / busy if final.completion_tokens > 1 and busy > 0 else 0.0
    return (f"[{final.completion_tokens} tokens, prompt {final.prompt_tokens} ({final.cached_tokens} cached), "
            f"TTFT {t.ttft_seconds * 1000:.0f} ms, TPOT {t.tpot_seconds * 1000:.0f} ms, {rate:.1f} tok/s]")


def stream(client: KVMeshClient | str, prompt: Any, max_tokens: int, out: TextIO | None = None,
           **sampling: Any) -> str:
    """Streams one answer to ``out`` followed by its stats line; returns the text.

    ``client`` is a client (closed here) or a plaintext address.
    """
    out = sys.stdout if out is None else out
    pieces: list[str] = []
    conn = KVMeshClient(client) if isinstance(client, str) else client
    with conn:
        for chunk in conn.generate(prompt, max_tokens, **sampling):
            out.write(chunk.text)
            out.flush()
            pieces.append(chunk.text)
            if chunk.HasField("final"):
                out.write(f"\n{_stats_line(chunk.final)}\n")
    return "".join(pieces)


def _as_json(client: KVMeshClient, prompt: Any, max_tokens: int, **sampling: Any) -> dict[str, Any]:
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[dict[str, Any]] = []
    final: Any = None
    with client:
        for chunk in client.generate(prompt, max_tokens, **sampling):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend({"token_id": lp.sampled.token_id, "logprob": lp.sampled.logprob,
                             "top": [{"token_id": t.token_id, "logprob": t.logprob} for t in lp.top]}
                            for lp in chunk.logprobs)
            if chunk.HasField("final"):
                final = chunk.final
    assert final is not None  # the scheduler always ends a successful stream with it
    t = final.timing
    result: dict[str, Any] = {
        "text": "".join(text), "token_ids": ids, "finish_reason": _FINISH.get(final.finish_reason, "unspecified"),
        "stop_reason": final.stop_reason or None,
        "usage": {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
                  "cached_tokens": final.cached_tokens, "preemptions": final.preemptions},
        "timing": {"queue_seconds": t.queue_seconds, "ttft_seconds": t.ttft_seconds, "tpot_seconds": t.tpot_seconds,
                   "e2e_seconds": t.e2e_seconds},
    }
    if sampling.get("logprobs") is not None:
        result["logprobs"] = logprobs
    return result


@_one_line_errors
def generate(ns: argparse.Namespace) -> int:
    """``kvmesh generate``."""
    prompt: Any = [("user", ns.prompt)] if ns.chat else ns.prompt
    if ns.json:
        print(json.dumps(_as_json(_client(ns), prompt, ns.max_tokens, **_sampling(ns))))
    else:
        stream(_client(ns), prompt, ns.max_tokens, **_sampling(ns))
    return 0


@_one_line_errors
def chat(ns: argparse.Namespace) -> int:
    """``kvmesh chat``: a conversation with history; ``/system``, ``/reset``, ``/exit``."""
    system = ns.system
    history: list[tuple[str, str]] = []
    print(f"kvmesh chat on {ns.address}; {CHAT_HELP}", flush=True)
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line.startswith("/"):
            command, _, arg = line.partition(" ")
            if command == "/exit":
                return 0
            if command == "/reset":
                history.clear()
                print("(conversation cleared)", flush=True)
            elif command == "/system":
                system = arg.strip()
                history.clear()
                print(f"(system prompt {'set' if system else 'cleared'}; conversation cleared)", flush=True)
            else:
                print(f"unknown command {command}; {CHAT_HELP}", flush=True)
            continue
        messages = ([("system", system)] if system else []) + history + [("user", line)]
        print("assistant> ", end="", flush=True)
        try:
            answer = stream(_client(ns), messages, ns.max_tokens, **_sampling(ns))
        except grpc.RpcError as exc:  # one bad turn (e.g. too long) need not end the session
            print(f"\n{rpc_error_line(exc)}", file=sys.stderr, flush=True)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return 1
            continue
        history.extend([("user", line), ("assistant", answer)])


def add_client_subcommands(sub: Any) -> None:
    """Registers ``generate`` and ``chat`` on the top-level parser's subcommands."""
    for name, fn in (("generate", generate), ("chat", chat)):
        p = sub.add_parser(name, help=f"{name} against a running suite")
        if name == "generate":
            p.add_argument("prompt")
            p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
            p.add_argument("--logprobs", type=int, default=None, metavar="N",
                           help="also return the top-N alternatives of each token (with --json)")
            p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
        else:
            p.add_argument("--system", default="", help="system prompt")
        p.add_argument("--address", default=DEFAULT_ADDRESS)
        p.add_argument("--max-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
        p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", ""),
                       help="API key sent as 'authorization: Bearer' (default: $KVMESH_API_KEY)")
        p.add_argument("--tls-ca", default=os.environ.get("KVMESH_TLS_CA", ""),
                       help="CA file: connect with TLS and verify the server (default: $KVMESH_TLS_CA)")
        p.add_argument("--tls-server-name", default="", help="name to verify in the server's certificate")
        p.set_defaults(func=fn)
