"""GET /openapi.json, built from the protocol models, and GET /docs, a page that renders it with no
network access at all (no CDN: servers often run where the internet is out of reach)."""
from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

from pydantic.json_schema import models_json_schema

from apiserver.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from apiserver.protocol_responses import ResponsesRequest

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def package_version() -> str:
    try:
        return version("supervise")
    except PackageNotFoundError:
        return "0+unknown"


def _body(ref: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}


def _responses(ok: str, *errors: int) -> dict:
    out = {"200": {"description": ok}}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for status in errors:
        out[str(status)] = {"description": "An error in the OpenAI format", **error}
    return out


def openapi_schema(routes: list[tuple[str, str, str]], api_key: bool) -> dict:
    """`routes`: (path, method, summary) of the routes this server has."""
    _, definitions = models_json_schema(
        [(m, "validation") for m in (ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                                     TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)],
        ref_template="#/components/schemas/{model}",
    )
    schemas = definitions["$defs"]
    schemas["ErrorResponse"] = _ERROR_SCHEMA
    schemas["TokenizeRequest"] = {
        "anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"}, {"$ref": "#/components/schemas/TokenizeChatRequest"}]
    }
    schemas["InvocationRequest"] = {
        "anyOf": [{"$ref": "#/components/schemas/ChatCompletionRequest"}, {"$ref": "#/components/schemas/CompletionRequest"}]
    }
    bodies = {
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/responses": "#/components/schemas/ResponsesRequest",
        "/invocations": "#/components/schemas/InvocationRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
    }
    paths: dict = {}
    for path, method, summary in routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", path)  # Starlette's converters ({model:path}) are not OpenAPI's
        operation = {"summary": summary, "responses": _responses(summary, 400, 401, 404, 503)}
        if path in bodies and method == "post":
            operation["requestBody"] = _body(bodies[path])
        parameters = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                      for name in re.findall(r"\{(\w+)\}", path)]
        if parameters:
            operation["parameters"] = parameters
        paths.setdefault(path, {})[method] = operation
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "supervise: an OpenAI-compatible API", "version": package_version()},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    return spec


DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>supervise API</title>
<style>
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}
details{border:1px solid #ccc;border-radius:6px;margin:.5rem 0;padding:.4rem .8rem}
summary{cursor:pointer} .m{display:inline-block;width:4.5rem;font-weight:700;text-transform:uppercase}
.get{color:#0a6} .post{color:#06c} pre{background:#f6f6f6;padding:.6rem;overflow:auto;font-size:13px}
</style></head><body>
<h1 id="title">supervise API</h1>
<p>The machine-readable description: <a href="openapi.json">openapi.json</a>. Clients: any OpenAI SDK, with
<code>base_url</code> set to this server's <code>/v1</code>.</p>
<div id="paths">Loading&hellip;</div>
<script>
fetch("openapi.json").then(r => r.json()).then(spec => {
  document.getElementById("title").textContent = spec.info.title + " " + spec.info.version;
  const schemas = spec.components.schemas, out = document.getElementById("paths");
  out.textContent = "";
  const resolve = s => s && s.$ref ? schemas[s.$ref.split("/").pop()] : s;
  for (const [path, ops] of Object.entries(spec.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      const d = document.createElement("details"), s = document.createElement("summary");
      s.innerHTML = `<span class="m ${method}">${method}</span><code></code> `;
      s.querySelector("code").textContent = path;
      s.append(op.summary || "");
      d.append(s);
      const body = op.requestBody && resolve(op.requestBody.content["application/json"].schema);
      if (body) {
        const pre = document.createElement("pre");
        pre.textContent = JSON.stringify(body, null, 2);
        d.append(pre);
      }
      out.append(d);
    }
  }
});
</script></body></html>
"""
