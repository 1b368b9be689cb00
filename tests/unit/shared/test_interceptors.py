"""``wrap_handler``: one check before every kind of behaviour, the error hook around it, on a real server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from shared.interceptors import wrap_handler

_IDENTITY: Callable[[bytes], bytes] = bytes


def _echo_handlers() -> grpc.GenericRpcHandler:
    def uu(req: bytes, ctx: grpc.ServicerContext) -> bytes:
        if req.lower() == b"boom":
            raise RuntimeError("boom")
        return b"uu:" + req

    def us(req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"us:" + req
        if req.lower() == b"boom":
            raise RuntimeError("boom")

    def su(reqs: Iterator[bytes], ctx: grpc.ServicerContext) -> bytes:
        return b"su:" + b"".join(reqs)

    def ss(reqs: Iterator[bytes], ctx: grpc.ServicerContext) -> Iterator[bytes]:
        for r in reqs:
            yield b"ss:" + r

    kw: dict[str, Any] = {"request_deserializer": _IDENTITY, "response_serializer": _IDENTITY}
    return grpc.method_handlers_generic_handler("t.Echo", {
        "UU": grpc.unary_unary_rpc_method_handler(uu, **kw), "US": grpc.unary_stream_rpc_method_handler(us, **kw),
        "SU": grpc.stream_unary_rpc_method_handler(su, **kw), "SS": grpc.stream_stream_rpc_method_handler(ss, **kw),
    })


class _Recorder(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses b"no" (upper-cased by its deserializer); records checks and errors; wraps only ``kinds``."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.checked: list[str] = []
        self.errors: list[str] = []

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]

        def check(request: Any, context: grpc.ServicerContext) -> None:
            self.checked.append(method)
            if request == b"NO":  # after the deserializer
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "refused")

        def on_error(exc: Exception, context: grpc.ServicerContext) -> None:
            self.errors.append(f"{method}:{exc}")
            context.abort(grpc.StatusCode.UNAVAILABLE, "mapped")

        return wrap_handler(continuation(details), check, on_error=on_error, kinds=self.kinds,
                            deserializer=lambda d: (lambda data: d(data.upper())) if d else None)


@pytest.fixture()
def serve() -> Iterator[Callable[[tuple[str, ...]], tuple[_Recorder, grpc.Channel]]]:
    started: list[tuple[grpc.Server, grpc.Channel]] = []

    def start(kinds: tuple[str, ...]) -> tuple[_Recorder, grpc.Channel]:
        rec = _Recorder(kinds)
        server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[rec], handlers=[_echo_handlers()])
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, channel))
        return rec, channel

    yield start
    for server, channel in started:
        channel.close()
        server.stop(0)


def test_every_kind_is_checked_first_and_gets_the_new_deserializer(serve: Any) -> None:
    rec, ch = serve(("unary_unary", "unary_stream", "stream_unary", "stream_stream"))
    assert ch.unary_unary("/t.Echo/UU")(b"a", timeout=10) == b"uu:A"
    assert list(ch.unary_stream("/t.Echo/US")(b"b", timeout=10)) == [b"us:B"]
    assert ch.stream_unary("/t.Echo/SU")(iter([b"c", b"d"]), timeout=10) == b"su:CD"
    assert list(ch.stream_stream("/t.Echo/SS")(iter([b"e"]), timeout=10)) == [b"ss:E"]
    assert rec.checked == ["UU", "US", "SU", "SS"] and rec.errors == []
    for call in (lambda: ch.unary_unary("/t.Echo/UU")(b"no", timeout=10),
                 lambda: list(ch.unary_stream("/t.Echo/US")(b"no", timeout=10))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "refused")


def test_errors_reach_the_hook_for_unary_and_streaming_responses(serve: Any) -> None:
    rec, ch = serve(("unary_unary", "unary_stream"))
    for call in (lambda: ch.unary_unary("/t.Echo/UU")(b"boom", timeout=10),
                 lambda: list(ch.unary_stream("/t.Echo/US")(b"boom", timeout=10))):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "mapped")
    assert rec.errors == ["UU:boom", "US:boom"]


def test_kinds_not_listed_pass_through_unwrapped(serve: Any) -> None:
    rec, ch = serve(("unary_unary",))
    assert ch.stream_unary("/t.Echo/SU")(iter([b"c"]), timeout=10) == b"su:c"  # original deserializer
    assert list(ch.unary_stream("/t.Echo/US")(b"no", timeout=10)) == [b"us:no"]
    assert rec.checked == []
