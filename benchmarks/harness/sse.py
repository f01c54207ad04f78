"""Reading a server-sent-events body line by line."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split at line feeds only: ``aiter_lines`` would also split at
    U+2028, U+0085 and the like, which JSON carries unescaped inside a token's text."""
    pending = ""
    async for chunk in response.aiter_text():
        *lines, pending = (pending + chunk).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending
