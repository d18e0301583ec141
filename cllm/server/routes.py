"""The HTTP routes: OpenAI endpoints under /v1 (behind the API key), operations endpoints beside them."""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from cllm.server.anthropic import count_tokens, create_message
from cllm.server.chat import create_chat_completion, render_chat
from cllm.server.chat_page import page_router
from cllm.server.completions import create_completion
from cllm.server.embeddings import create_embeddings
from cllm.server.errors import APIError, bad_request
from cllm.server.images import message_contents
from cllm.server.input_tokens import chat_input_tokens, response_input_tokens
from cllm.server.json_route import JSONBodyRoute
from cllm.server.metrics import CONTENT_TYPE
from cllm.server.ready import determinism_of
from cllm.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)
from cllm.server.responses import create_response, delete_response, get_response, list_input_items
from cllm.router import ModelInfo, ModelUnavailable, Router
from cllm.server.state import Phase, ServerState, get_state, unavailable_error
from cllm.server.token_pieces import token_pieces
from cllm.server.tokens import encode_prompt


def _as_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) and not isinstance(obj, type) else obj


def _cards(state: ServerState, info: ModelInfo) -> list[ModelCard]:
    """One card per name of a declared model (its primary name first)."""
    return [ModelCard(id=name, created=state.started_at, max_model_len=info.max_model_len, root=info.name,
                      status=info.status, loaded=info.status == "loaded", backend=info.backend)  # type: ignore[arg-type]
            for name in info.aliases]


def _router(state: ServerState) -> Router:
    if state.router is None or (state.single and state.loaded is None):
        raise state._unavailable()  # (a single-model server lists its model once it is loaded, as before)
    return state.router


async def list_models(request: Request) -> ModelList:
    """Every declared model, each name and alias a card, with whether it is loaded (nothing is loaded by
    listing)."""
    state = get_state(request)
    router = _router(state)
    return ModelList(data=[card for info in router.models() for card in _cards(state, info)])


async def get_model(model_id: str, request: Request) -> ModelCard:
    state = get_state(request)
    router = _router(state)
    spec = state.check_model(model_id, param="model_id")
    card = next(c for c in _cards(state, _info_of(router, spec.name)) if c.id in (model_id, spec.name))
    return card if card.id == model_id else card.model_copy(update={"id": model_id})


def _info_of(router: Router, name: str) -> ModelInfo:
    return next(info for info in router.models() if info.name == name)


async def load_model(model_id: str, request: Request) -> dict[str, Any]:
    """POST /v1/models/{name}/load: load it now (it then idles out by its keep_alive)."""
    state = get_state(request)
    if state.phase is not Phase.READY or state.router is None:
        raise state._unavailable()
    spec = state.check_model(model_id, param="model_id")
    try:
        info = await state.router.load(spec.name)
    except ModelUnavailable as err:
        raise unavailable_error(err) from None
    return {"model": _model_report(info)}


async def unload_model(model_id: str, request: Request) -> dict[str, Any]:
    """POST /v1/models/{name}/unload[?force=true]: unload it now; a busy model is a 409 unless force (which
    aborts its requests)."""
    state = get_state(request)
    if state.router is None:
        raise state._unavailable()
    spec = state.check_model(model_id, param="model_id")
    if state.single:
        raise APIError(409, f"the model {spec.name!r} is this server's only model (none declared): it stays "
                            "loaded for the server's life", code="model_pinned")
    force = request.query_params.get("force", "false").lower() in ("1", "true", "yes")
    try:
        info = await state.router.unload(spec.name, force=force)
    except ModelUnavailable as err:
        raise APIError(409, str(err), code=err.code) from None
    return {"model": _model_report(info)}


def _model_report(info: ModelInfo) -> dict[str, Any]:
    return dataclasses.asdict(info) | {"aliases": list(info.aliases)}


async def engine_state(request: Request) -> dict[str, Any]:
    """Live scheduler state of one model (``?model=NAME``, else the default): every running request (id,
    slot, tokens, age), the engine stats, its backend's choices; and ``models``: every declared model's
    status, memory and load time. Nothing is loaded by asking."""
    state = get_state(request)
    if state.router is None:
        raise state._unavailable()
    spec = state.check_model(request.query_params.get("model"), param="model")
    models = [_model_report(info) for info in state.router.models()]
    engine = state.router.engine_of(spec.name)
    if engine is None:
        if state.single:
            raise state._unavailable()
        return {"model": spec.name, "status": _info_of(state.router, spec.name).status, "phase": state.phase.value,
                "models": models}
    report = _engine_report(engine, spec.name)
    report["images"]["max_body_bytes"] = state.max_body_bytes()  # what a request body may hold now (auto grows with images)
    return {**report, "phase": state.phase.value, "models": models}


def _engine_report(engine: Any, name: str) -> dict[str, Any]:
    running = [_as_dict(r) for r in engine.running_requests()]
    stats = engine.stats()
    stats_dict = _as_dict(stats)
    if isinstance(stats_dict, dict) and hasattr(stats, "prefix_cache_hit_rate"):
        stats_dict["prefix_cache_hit_rate"] = stats.prefix_cache_hit_rate  # a property, not a field
        stats_dict["spec_acceptance_rate"] = stats.spec_acceptance_rate
        stats_dict["spec_tokens_per_verify"] = stats.spec_tokens_per_verify
    # the file llama.cpp runs (a converted copy under llama_cpp.weights: auto / q8_0 / f16), where known
    backend = getattr(getattr(engine, "engine", None), "backend", None)
    weights = getattr(backend, "weights_path", None)
    verdict = getattr(backend, "flash_attn_verdict", None)  # what llama.cpp was given, why, and the probe's times
    return {"model": name, "status": "loaded", "weights": weights and str(weights),
            "flash_attn": getattr(backend, "flash_attn", None), "flash_attn_verdict": verdict and _as_dict(verdict),
            # blocks ahead that llama.cpp's quantised CPU matmul prefetches (cllm's patched build), None without it
            "q0_prefetch_blocks": getattr(backend, "q0_prefetch_blocks", None),
            "determinism": _determinism(determinism_of(engine)), "engine_core": _core_state(engine),
            "images": {"accepted": bool(getattr(engine, "supports_images", False)),
                       "encoder": getattr(backend, "vision_text", None)},
            "stats": stats_dict, "running": running}


def _determinism(determinism: Any) -> dict[str, Any] | None:
    """model.deterministic as the backend keeps it: on, promised, how, and what it cannot promise."""
    if determinism is None:
        return None
    return {"on": determinism.on, "promised": determinism.promised, "how": list(determinism.how),
            "not_promised": list(determinism.not_promised)}


def _core_state(engine: Any) -> dict[str, Any] | None:
    """The engine core in its own process: restarts by the supervisor so far, and whether one is under way
    (None in-process)."""
    if not hasattr(engine, "num_restarts"):
        return None
    return {"pid": getattr(engine, "core_pid", None), "restarts": engine.num_restarts,
            "restarting": engine.restarting, "failure": engine.failure}


async def health(request: Request) -> JSONResponse:
    """Single model: ok while its engine runs. Several: ok while the server is up (a model that failed or
    died fails only its own requests), with each model's status."""
    state = get_state(request)
    if state.phase is Phase.READY and not state.single and state.router is not None:
        return JSONResponse({"status": "ok", "models": {i.name: i.status for i in state.router.models()}})
    if state.phase is Phase.READY:
        engine = state.loaded.engine if state.loaded is not None else None
        if engine is not None and engine.is_running:
            return JSONResponse({"status": "ok"})
        # Loaded once, but the engine has died (or its core is being restarted): every request would get
        # 503, so say so here, with the reason.
        dead = {"status": "engine_restarting" if getattr(engine, "restarting", False) else "engine_dead"}
        if getattr(engine, "failure", None):
            dead["error"] = engine.failure
        return JSONResponse(dead, status_code=503)
    body: dict[str, Any] = {"status": state.phase.value}
    if state.load_error:
        body["error"] = state.load_error
    return JSONResponse(body, status_code=503)


async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """vLLM's body (``prompt`` or ``messages``) or llama-server's (``content``, ``add_special``,
    ``with_pieces``)."""
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    error = body.input_error()
    if error is not None:
        raise bad_request(error[1], param=error[0])
    if body.messages is not None:
        contents = await message_contents(body.messages, state.config.images, model.engine, model.name, request)
        prompt = await run_in_threadpool(render_chat, model.engine, body.messages, body.add_generation_prompt is not False,
                                         None, False, contents)
        try:
            tokens = await run_in_threadpool(model.engine.expanded_ids, prompt)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
    else:
        param = "prompt" if body.prompt is not None else "content"
        try:
            tokens = await run_in_threadpool(encode_prompt, model.engine.tokenizer, body.text or "",
                                             add_special=body.adds_special)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"cannot tokenize: {exc}", param=param) from None
    shown: list[int] | list[TokenPiece] = tokens
    if body.with_pieces:
        shown = await run_in_threadpool(token_pieces, model.engine.tokenizer, tokens)
    return TokenizeResponse(tokens=shown, count=len(tokens), max_model_len=model.max_model_len)


async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = get_state(request)
    model = await state.model_for(request, body.model, keep_alive=body.keep_alive)
    vocab = model.limits.vocab_size
    bad = await run_in_threadpool(lambda: [t for t in body.tokens if not 0 <= t < vocab])
    if bad:
        raise bad_request(f"invalid token ids {bad[:8]}: must be in [0, {vocab})", param="tokens")
    # A long token list decodes for a while: off the event loop (issue 9 defect 17).
    text = await run_in_threadpool(model.engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text, content=text)


def _openai_routes(router: APIRouter) -> None:
    """The OpenAI routes, served under /v1 and, as llama-server does, also without it (clients whose base
    URL lacks /v1)."""
    # The generation routes skip FastAPI's per-request dependency solving (json_route.py: the same parsing,
    # validation and errors for a fraction of the CPU, which every request of a busy server pays).
    router.add_api_route("/completions", create_completion, methods=["POST"], response_model=None,
                         route_class_override=JSONBodyRoute)
    router.add_api_route("/chat/completions", create_chat_completion, methods=["POST"], response_model=None,
                         route_class_override=JSONBodyRoute)
    router.add_api_route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"], response_model=None)
    router.add_api_route("/embeddings", create_embeddings, methods=["POST"], response_model=None,
                         route_class_override=JSONBodyRoute)
    router.add_api_route("/responses", create_response, methods=["POST"], response_model=None,
                         route_class_override=JSONBodyRoute)
    router.add_api_route("/responses/input_tokens", response_input_tokens, methods=["POST"], response_model=None)
    router.add_api_route("/responses/{response_id}", get_response, methods=["GET"], response_model=None)
    router.add_api_route("/responses/{response_id}", delete_response, methods=["DELETE"], response_model=None)
    router.add_api_route("/responses/{response_id}/input_items", list_input_items, methods=["GET"], response_model=None)
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/models/{model_id:path}/load", load_model, methods=["POST"])
    router.add_api_route("/models/{model_id:path}/unload", unload_model, methods=["POST"])
    router.add_api_route("/models/{model_id:path}", get_model, methods=["GET"])


def _openai_router() -> APIRouter:
    router = APIRouter(prefix="/v1")
    _openai_routes(router)
    # Only under /v1: Anthropic's clients add /v1 themselves, and /v1/engine is cllm's own.
    router.add_api_route("/messages", create_message, methods=["POST"], response_model=None,
                         route_class_override=JSONBodyRoute)
    router.add_api_route("/messages/count_tokens", count_tokens, methods=["POST"], response_model=None)
    router.add_api_route("/engine", engine_state, methods=["GET"])
    router.add_api_route("/health", health, methods=["GET"], response_model=None, include_in_schema=False)
    return router


def _unprefixed_router() -> APIRouter:
    """The same handlers without /v1 (left out of the OpenAPI schema, which lists each once)."""
    router = APIRouter(include_in_schema=False)
    _openai_routes(router)
    return router


def _ops_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"], response_model=None)
    router.add_api_route("/metrics", metrics, methods=["GET"], response_model=None)
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/detokenize", detokenize, methods=["POST"])
    return router


def routers() -> list[APIRouter]:
    """All routers of the app (the API key, when set, is checked by ApiKeyMiddleware; the chat page is public)."""
    return [_openai_router(), _unprefixed_router(), _ops_router(), page_router()]


# Routes whose path is a fixed string, for the metrics' route label (anything else is "other").
_OPENAI_PATHS = ("/completions", "/chat/completions", "/chat/completions/input_tokens", "/embeddings", "/models",
                 "/responses", "/responses/input_tokens")
KNOWN_PATHS = frozenset({
    *_OPENAI_PATHS, *(f"/v1{p}" for p in _OPENAI_PATHS), "/v1/engine", "/v1/messages", "/v1/messages/count_tokens",
    "/health", "/v1/health", "/metrics", "/tokenize", "/detokenize", "/",
})
