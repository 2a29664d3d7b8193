"""How a generating route answers once its requests are submitted: it waits for the first step
(so an early failure still gets its status), then streams SSE or collects the whole answer; a
client that leaves is a 499 and its requests are aborted. Shared by the OpenAI and Anthropic
routes."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response

from services.gateway.http.body import ClientGone, watch
from services.gateway.http.sse import SSEResponse


async def respond(request: Request, group, stream: Callable[[tuple], AsyncIterator[str]] | None,
                 collect: Callable[[tuple], Awaitable[None]], headers: dict | None = None) -> Response | None:
    """`group`: the ChoiceGroup of the submitted requests. `stream(first)` gives the SSE events
    (None: not a stream); `collect(first)` reads the rest of a whole answer. -> the SSE
    response, a 499, or None once the whole answer is collected (the group aborted: the caller
    builds its body)."""
    aiter(group)
    try:
        first = await watch(request, group, anext(group))
        if first[1].error is not None:
            group.abort()
            raise first[1].error
        if stream is not None:
            def on_disconnect() -> None:
                request.state.outcome = "client_disconnected"
                group.abort()

            return SSEResponse(stream(first), on_disconnect=on_disconnect,
                               headers={"Cache-Control": "no-cache", **(headers or {})})
        await watch(request, group, collect(first))
    except ClientGone:
        request.state.outcome = "client_disconnected"
        return Response(status_code=499)
    except BaseException:
        group.abort()
        raise
    group.abort()
    return None
