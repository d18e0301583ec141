"""The README's main job: `cllm serve` with no settings at all (machine-chosen threads, default slots
and context) loads the embedded model and answers chat and embeddings. Every other server test pins
--n-threads, so without this one a broken default (the n_threads default once raised NameError at
start-up) would pass the whole suite."""
from __future__ import annotations

from cllm.stress.server_process import finish_server, start_server


def test_cllm_serve_on_its_defaults_answers_chat_and_embeddings() -> None:
    server = start_server(threads=None)
    try:
        with server.http(timeout=120) as client:
            chat = client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
            emb = client.post("/v1/embeddings", json={"input": ["hello there"]})
    finally:
        log = finish_server(server)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    assert emb.status_code == 200, emb.text
    assert len(emb.json()["data"][0]["embedding"]) == 576  # SmolLM2-135M's hidden size
    assert "Traceback" not in log
