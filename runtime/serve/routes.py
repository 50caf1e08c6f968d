"""The server's endpoints, as one module-level router (vLLM's pattern): each route finds the serving object on
`app.state` (runtime/serve/serving.py) and asks it; errors are raised as protocol.APIError and become OpenAI's
error objects in runtime/serve/app.py."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from k2trt.runtime.serve import protocol
from k2trt.runtime.serve.serving import Serving

router = APIRouter()


def serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request):
    stopped = serving(request).stopped()
    if stopped is not None:
        return JSONResponse(stopped.body(), status_code=stopped.status)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(serving(request).metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [serving(request).model_card()]}


@router.post("/v1/chat/completions")
async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
    return await serving(request).chat(body, request)


@router.post("/v1/completions")
async def completions(body: protocol.CompletionRequest, request: Request):
    return await serving(request).completions(body, request)
