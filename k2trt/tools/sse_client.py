"""The client side of the server's streamed answers, for the benchmarks: each `data:` chunk of one request."""

from __future__ import annotations

import json

from k2trt.errors import K2Error


async def stream_chunks(client, url: str, body: dict):
    """POST a streamed request (chat when it has messages, else a completion) and yield each chunk's JSON; a status
    other than 200 is a K2Error with the start of the server's answer."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise K2Error(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def auth_headers(api_key: str | None) -> dict:
    """The bearer token a server behind a key (k2trt's --api-key, vLLM's) asks for."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
