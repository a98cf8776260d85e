"""The server's API documentation works without a network: /docs is made from its own OpenAPI."""

from __future__ import annotations

import re

from test_server import LOCAL

from cernenv.server import ServerConfig, create_cernenv_app


def test_docs_load_nothing_from_the_network_and_document_every_route():
    from starlette.testclient import TestClient

    with TestClient(create_cernenv_app(ServerConfig(), require_guard=False), base_url=LOCAL) as http:
        page = http.get("/docs")
        openapi = http.get("/openapi.json").json()
        redoc = http.get("/redoc")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    text = page.text
    external = re.findall(r"""<(?:script|link|img)[^>]*(?:src|href)=["']?(https?:)?//""", text)
    assert not external and "<script" not in text, "FastAPI's page loaded Swagger UI from a CDN: blank offline"
    for path in openapi["paths"]:
        assert f"<code>{path}</code>" in text, path
    assert "/reset" in openapi["paths"] and 'id="schema-' in text
    assert redoc.status_code == 200 and redoc.text == text


def test_the_server_says_what_it_is_and_where_episodes_are_played():
    """`/` (and `/web`) is a page that names the server's mode and says to play on WS /ws; /docs
    opens with the same words, as paragraphs (not raw markdown), and no longer tells a reader to
    call POST /step repeatedly, which answers 409 over HTTP."""
    from starlette.testclient import TestClient

    with TestClient(create_cernenv_app(ServerConfig(), require_guard=False), base_url=LOCAL) as http:
        landing, web, docs = http.get("/"), http.get("/web"), http.get("/docs").text
        step = http.post("/step", json={"action": {}})
    assert landing.status_code == 200 and landing.text == web.text
    assert "WS /ws" in landing.text and "<b>evaluation</b>" in landing.text and "CERNEnvClient" in landing.text
    assert "WS /ws" in docs and "**" not in docs and "Swagger" not in docs and "repeatedly" not in docs
    assert step.status_code in (409, 422) and "answers 409" in docs


def test_the_page_shows_the_address_it_was_asked_at_and_the_package_s_version():
    """`/`'s client snippet said port 8000 whatever the port, and "CERNenv 1.0.0" (OpenEnv's app
    version) where the package is 0.1.0; `/web` was the same page again: now it sends a browser to `/`."""
    import html

    from starlette.testclient import TestClient

    from cernenv import __version__

    with TestClient(create_cernenv_app(ServerConfig(), require_guard=False), base_url="http://127.0.0.1:8123") as http:
        landing, web = http.get("/"), http.get("/web", follow_redirects=False)
        info = http.get("/openapi.json").json()["info"]
    page = html.unescape(landing.text)
    assert 'CERNEnvClient(base_url="http://127.0.0.1:8123")' in page and "8000" not in page
    assert f"<small>{__version__}</small>" in page and "1.0.0" not in page and info["version"] == __version__
    assert web.status_code == 307 and web.headers["location"] == "/"
