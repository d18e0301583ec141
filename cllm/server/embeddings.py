"""POST /v1/embeddings: texts or token-id lists in, unit-length pooled hidden states out.

The engine batches the inputs of concurrent requests into the same forward
passes (AsyncLLM.embed). ``encoding_format: "base64"`` (what the openai client
asks for by default) carries each vector as little-endian float32 bytes, as on
api.openai.com.
"""
from __future__ import annotations

import base64
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import Response

from cllm.outputs import EmbeddingOutput
from cllm.server.access_log import CLIENT_CLOSED, access_record
from cllm.server.disconnect import ClientDisconnected, unless_disconnected
from cllm.server.errors import bad_request, engine_error
from cllm.server.state import get_state

# Inputs in one request (api.openai.com allows 2048).
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """The request body (unknown fields ignored, known ones strictly typed, as the other routes)."""

    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    keep_alive: float | int | str | None = None  # how long the model stays loaded after this request (Ollama's keep_alive)
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(raw: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(raw, str):
        return [raw]
    if not raw:
        raise bad_request("input must not be an empty list", param="input")
    if isinstance(raw[0], int):
        return [list(raw)]  # type: ignore[arg-type]
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"too many inputs ({len(raw)}): at most {MAX_INPUTS} per request", param="input")
    return list(raw)  # type: ignore[arg-type]


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def build_response(outputs: list[EmbeddingOutput], model: str, encoding: str) -> EmbeddingResponse:
    data = [EmbeddingData(index=i, embedding=_encode(o.embedding, encoding)) for i, o in enumerate(outputs)]
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Validate, embed (batched with concurrent requests by the engine) and answer."""
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    inputs = _inputs(body.input)
    record = access_record(request)
    if record is not None:
        record.request_id = f"embd-{uuid.uuid4().hex}"
    try:
        outputs = await unless_disconnected(request, model.engine.embed(inputs))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), param="input") from None
    except Exception as exc:
        raise engine_error(exc, prompt_param="input") from None
    dims = len(outputs[0].embedding)
    if body.dimensions is not None and body.dimensions != dims:
        raise bad_request(f"invalid dimensions={body.dimensions}: this model's embeddings have {dims}", param="dimensions")
    if record is not None:
        record.prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    resp = build_response(outputs, model.name, body.encoding_format or "float")
    return Response(resp.model_dump_json(), media_type="application/json")
