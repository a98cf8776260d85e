"""`GET /docs` (and `/redoc`) as one HTML page made from the server's own OpenAPI document, with
no script, stylesheet or font from anywhere else. FastAPI's pages load Swagger UI and ReDoc from a
CDN, so without a network (the machines this project runs on, an air-gapped cluster) they were
blank. `GET /openapi.json` is FastAPI's, unchanged: any OpenAPI tool reads it.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any, Dict, Mapping

DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc")
"""FastAPI's documentation routes, replaced by `offline_docs`."""
STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#0f172a}"
    "h2{border-bottom:1px solid #cbd5e1;padding-bottom:.2rem}section{margin:1.2rem 0}"
    ".method{display:inline-block;min-width:4.5rem;font-weight:bold;font-family:monospace}"
    "code,pre{font-family:ui-monospace,monospace;font-size:.85rem}pre{background:#f1f5f9;padding:.6rem;"
    "overflow-x:auto}table{border-collapse:collapse}td,th{padding:.15rem .6rem;text-align:left;"
    "vertical-align:top}"
)


def _schema_name(schema: Mapping[str, Any]) -> str:
    reference = schema.get("$ref", "")
    return reference.rsplit("/", 1)[-1] if reference else ""


def _operation(path: str, method: str, operation: Mapping[str, Any]) -> str:
    parts = [
        f'<section><h3><span class="method">{html.escape(method.upper())}</span> <code>{html.escape(path)}</code>'
        f" {html.escape(operation.get('summary', ''))}</h3>"
    ]
    if operation.get("description"):
        parts.append(_paragraphs(operation["description"]))
    parameters = operation.get("parameters") or []
    if parameters:
        rows = "".join(
            f"<tr><td><code>{html.escape(p.get('name', ''))}</code></td><td>{html.escape(p.get('in', ''))}</td>"
            f"<td>{'required' if p.get('required') else ''}</td>"
            f"<td>{html.escape(p.get('description', ''))}</td></tr>"
            for p in parameters
        )
        parts.append(f"<table><tr><th>parameter</th><th>in</th><th></th><th></th></tr>{rows}</table>")
    body = (operation.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        name = _schema_name(body)
        shown = f'<a href="#schema-{html.escape(name)}">{html.escape(name)}</a>' if name else ""
        parts.append(f"<p>Request body (JSON): {shown}</p>" if name else f"<pre>{html.escape(json.dumps(body))}</pre>")
    responses = operation.get("responses") or {}
    if responses:
        items = ", ".join(
            f"{html.escape(str(code))} {html.escape(str(answer.get('description', '')))}"
            for code, answer in responses.items()
        )
        parts.append(f"<p>Responses: {items}</p>")
    return "".join(parts) + "</section>"


SERVER_DESCRIPTION = """A simulated LHC discovery campaign as an OpenEnv environment. An agent configures the beam,
takes data, builds and fits an invariant-mass spectrum, estimates significance, measures spin
and claims a discovery (or that nothing is there).

Play an episode on the WebSocket WS /ws, one session per connection: send {"type": "reset",
"data": {...}}, then {"type": "step", "data": <action>} until the observation says done. From
Python: cernenv.client.CERNEnvClient(base_url=...).sync(). MCP clients use POST /mcp.

Over plain HTTP each request gets a fresh environment: POST /reset returns a first observation
and forgets it, and POST /step answers 409 (no episode). GET /evaluation says how this server
grades; GET /schema gives the action and observation schemas."""
"""What the server says it is, on `/` and atop `/docs` (plain paragraphs; OpenAPI's `description`)."""


_BOLD = re.compile(r"\*\*(.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")
_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s+")


def _inline(text: str) -> str:
    return _CODE.sub(r"<code>\1</code>", _BOLD.sub(r"<b>\1</b>", html.escape(text)))


def _paragraphs(text: str) -> str:
    """The few markdown forms route descriptions use (paragraphs, lists, **bold**, `code`) as HTML."""
    parts = []
    for block in (part.strip("\n") for part in text.split("\n\n")):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines:
            continue
        items = [line for line in lines if _ITEM.match(line)]
        if items:
            head = lines[: lines.index(items[0])]
            if head:
                parts.append(f"<p>{_inline(' '.join(line.strip() for line in head))}</p>")
            parts.append("<ul>" + "".join(f"<li>{_inline(_ITEM.sub('', line))}</li>" for line in items) + "</ul>")
        else:
            parts.append(f"<p>{_inline(' '.join(line.strip() for line in lines))}</p>")
    return "".join(parts)


def landing_page(title: str, version: str, mode: str, base_url: str = "http://127.0.0.1:8000") -> str:
    """`GET /`: what the server is, how to play on it from `base_url` (the address the page was
    asked for), and where its documentation is."""
    snippet = (
        "from cernenv.client import CERNEnvClient\n"
        "from cernenv.models import ExperimentAction\n\n"
        f"with CERNEnvClient(base_url={json.dumps(base_url)}).sync() as env:\n"
        "    result = env.reset()\n"
        '    result = env.step(ExperimentAction(action_type="configure_beam", '
        'parameters={"beam_energy_tev": 13.6}))'
    )
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)} <small>{html.escape(version)}</small></h1>"
        f"<p>Mode: <b>{html.escape(mode)}</b> (<a href='/evaluation'>/evaluation</a>).</p>"
        f"{_paragraphs(SERVER_DESCRIPTION)}<pre>{html.escape(snippet)}</pre>"
        "<p><a href='/docs'>/docs</a>: every route; <a href='/openapi.json'>/openapi.json</a>: the same, "
        "machine-readable; <a href='/health'>/health</a>.</p></body></html>"
    )


def offline_docs(openapi: Mapping[str, Any]) -> str:
    """The whole API as one self-contained HTML page: each route with its parameters, request body
    and responses, then every schema as JSON."""
    info: Dict[str, Any] = dict(openapi.get("info") or {})
    title = html.escape(str(info.get("title", "API")))
    sections = [
        _operation(path, method, operation)
        for path, methods in sorted((openapi.get("paths") or {}).items())
        for method, operation in methods.items()
        if isinstance(operation, Mapping)
    ]
    schemas = (openapi.get("components") or {}).get("schemas") or {}
    schema_sections = [
        f'<section id="schema-{html.escape(name)}"><h3>{html.escape(name)}</h3>'
        f"<pre>{html.escape(json.dumps(schema, indent=1))}</pre></section>"
        for name, schema in sorted(schemas.items())
    ]
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{title}</title><style>{STYLE}</style></head><body>"
        f"<h1>{title} <small>{html.escape(str(info.get('version', '')))}</small></h1>"
        f"{_paragraphs(str(info.get('description', '')))}"
        '<p>The machine-readable document: <a href="/openapi.json">/openapi.json</a>.</p>'
        f"<h2>Routes</h2>{''.join(sections)}<h2>Schemas</h2>{''.join(schema_sections)}</body></html>"
    )


def serve_offline_docs(app: Any) -> None:
    """Replace FastAPI's `/docs` and `/redoc` (CDN pages) with `offline_docs` of the app's OpenAPI,
    made on first request (every route is then in place) and kept; serve `landing_page` at `/`, with
    the address it was asked for, and send `/web` there unless OpenEnv's web UI holds it."""
    from fastapi.responses import HTMLResponse, RedirectResponse

    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in DOCS_PATHS]
    page: list = []

    async def docs() -> HTMLResponse:
        if not page:
            page.append(offline_docs(app.openapi()))
        return HTMLResponse(page[0])

    for path in ("/docs", "/redoc"):
        app.add_api_route(path, docs, methods=["GET"], include_in_schema=False)

    async def landing(request: Any) -> HTMLResponse:  # a Starlette endpoint: handed the request
        config = getattr(app.state, "cernenv_config", None)
        base_url = str(request.base_url).rstrip("/")
        return HTMLResponse(landing_page(app.title, app.version, getattr(config, "mode", "?"), base_url))

    async def to_landing(request: Any) -> RedirectResponse:
        return RedirectResponse("/")

    app.add_route("/", landing, methods=["GET"], include_in_schema=False)
    if not any(getattr(route, "path", None) == "/web" for route in app.router.routes):
        # OpenEnv's web UI lives at /web when ENABLE_WEB_INTERFACE is set; without it, /web is this page
        app.add_route("/web", to_landing, methods=["GET"], include_in_schema=False)
