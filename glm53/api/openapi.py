"""The OpenAPI 3.1 document of the HTTP API, generated from the msgspec Structs."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from glm53 import __version__
from glm53.api.schemas import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    GenerateRequest,
    GenerateResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

_JSON_OBJECT = dict[str, Any]

# (method, path, request body, 200 body, summary); a 200 body of str is text/plain
ENDPOINTS: tuple[tuple[str, str, Any, Any, str], ...] = (
    (
        "post",
        "/v1/chat/completions",
        ChatRequest,
        ChatCompletion,
        "Chat completion; SSE chunks with stream=true",
    ),
    (
        "post",
        "/v1/completions",
        CompletionRequest,
        Completion,
        "Text completion; SSE chunks with stream=true",
    ),
    ("get", "/v1/models", None, ModelList, "The served model"),
    ("get", "/v1/models/{model}", None, ModelCard, "One model by id"),
    ("get", "/health", None, Health, "200 when the model is loaded, 503 before (no key needed)"),
    ("get", "/stats", None, _JSON_OBJECT, "Requests, tokens, queue and the engine's tier counters"),
    ("get", "/server_info", None, _JSON_OBJECT, "Every effective setting and its source"),
    ("get", "/metrics", None, str, "Prometheus text format"),
    ("get", "/dashboard", None, str, "Live tier page (HTML; polls /stats; no key needed)"),
    ("post", "/generate", GenerateRequest, GenerateResponse, "SGLang-shaped generation"),
    ("post", "/tokenize", TokenizeRequest, TokenizeResponse, "Token ids of a text"),
    ("get", "/openapi.json", None, _JSON_OBJECT, "This document"),
    (
        "post",
        "/admin/save_heat",
        None,
        _JSON_OBJECT,
        "Write the VRAM expert cache's warm-start heat list now (GPU engine; 409 otherwise)",
    ),
    (
        "get",
        "/admin/verify",
        None,
        _JSON_OBJECT,
        "Tier check on demand (?n=64 records): ram_bad, vram_bad, table_bad and each bad "
        "record's layer and expert (409 for an engine without tiers)",
    ),
)
_ERRORS = {
    "400": "Invalid request",
    "401": "Missing or wrong API key",
    "404": "Unknown model or route",
    "409": "The engine has no such state (e.g. no VRAM expert cache)",
    "413": "Body too large",
    "429": "Queue full (see Retry-After)",
    "500": "Engine error",
    "503": "Model loading or server stopping",
}


@functools.cache
def openapi_document() -> bytes:
    types = [t for _, _, req, res, _ in ENDPOINTS for t in (req, res) if t not in (None, str)]
    schemas, components = msgspec.json.schema_components(
        [*types, ErrorBody], ref_template="#/components/schemas/{name}"
    )
    by_type = dict(zip([*types, ErrorBody], schemas, strict=True))
    error_ref = by_type[ErrorBody]
    paths: dict[str, dict[str, Any]] = {}
    for method, path, req, res, summary in ENDPOINTS:
        if res is str:
            text_type = "text/html" if path == "/dashboard" else "text/plain"
            ok = {"description": "OK", "content": {text_type: {"schema": {"type": "string"}}}}
        else:
            ok = {"description": "OK", "content": {"application/json": {"schema": by_type[res]}}}
            if req in (ChatRequest, CompletionRequest, GenerateRequest):
                ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "summary": summary,
            "operationId": (method + path).replace("/", "_").replace(".", "_").strip("_"),
            "responses": {
                "200": ok,
                **{
                    code: {
                        "description": text,
                        "content": {"application/json": {"schema": error_ref}},
                    }
                    for code, text in _ERRORS.items()
                },
            },
        }
        if "{model}" in path:
            op["parameters"] = [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        if req is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": by_type[req]}},
            }
        if path not in ("/health", "/dashboard"):
            op["security"] = [{"bearer": []}, {}]
        paths.setdefault(path, {})[method] = op
    document = {
        "openapi": "3.1.0",
        "info": {
            "title": "glm53",
            "version": __version__,
            "description": "OpenAI-compatible API of glm53",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    return msgspec.json.encode(document)
