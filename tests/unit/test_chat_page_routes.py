"""The chat page's routes on the in-process app (fake backend): public with and without an API key, a strict
CSP, the package ships the files; and the page script never hands text to the HTML parser."""
from __future__ import annotations

import re
from importlib import resources

import pytest
from fastapi.testclient import TestClient

import cllm
from cllm.server.app import create_app
from cllm.server.chat_page import PAGE_PATHS
from tests.unit.fakes import FakeBackend, fake_config

KEY = "unit-test-key"


def _client(**overrides) -> TestClient:
    config = fake_config(**overrides)
    app = create_app(config, engine=cllm.AsyncLLM(backend=FakeBackend(slots=2), config=config))
    return TestClient(app, base_url="http://localhost")


@pytest.mark.parametrize("api_key", [None, KEY])
def test_page_files_are_public_and_the_api_is_not(api_key):
    with _client(api_key=api_key) as client:
        for path in sorted(PAGE_PATHS):
            resp = client.get(path)
            assert resp.status_code == 200, (path, resp.text)
            assert resp.headers["x-content-type-options"] == "nosniff"
            assert "default-src 'none'" in resp.headers["content-security-policy"]
        assert client.get("/").headers["content-type"] == "text/html; charset=utf-8"
        assert client.get("/static/chat.js").headers["content-type"].startswith("text/javascript")
        models = client.get("/v1/models")
        assert models.status_code == (401 if api_key else 200)
        if api_key:
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
            assert client.get("/metrics").status_code == 401
            assert client.get("/static/other.js").status_code == 401  # only the page's own files are public


def test_page_without_a_key_still_refuses_foreign_host_headers():
    with _client() as client:
        assert client.get("/", headers={"Host": "evil.example"}).status_code == 403


def test_page_is_not_in_the_openapi_schema():
    with _client() as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/static/chat.js" not in paths


def test_the_script_never_parses_text_as_html():
    source = (resources.files("cllm.server") / "static" / "chat.js").read_text()
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "createContextualFragment", "DOMParser"):
        assert sink not in code, sink
    html = (resources.files("cllm.server") / "static" / "index.html").read_text()
    assert not re.search(r"<script>(?!</script>)", html)  # no inline script (the CSP would refuse it anyway)
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing fetched from elsewhere
