"""The README's main job: `cllm serve` with no settings at all (machine-chosen threads, default slots
and context) loads the embedded model and answers chat and embeddings. Every other server test pins
--n-threads, so without this one a broken default (the n_threads default once raised NameError at
start-up) would pass the whole suite."""
from __future__ import annotations

import re

from cllm.backends.llama_cpp.native import LlamaModelHandle
from cllm.backends.llama_cpp.sizing import MAX_AUTO_SEQS, available_memory, kv_shape
from cllm.model_path import resolve_model_path
from cllm.stress.server_process import finish_server, start_server


def test_cllm_serve_on_its_defaults_answers_chat_and_embeddings() -> None:
    available_before = available_memory()  # what the server reads at start-up, give or take its own load
    server = start_server(threads=None)
    try:
        with server.http(timeout=120) as client:
            chat = client.post("/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
            emb = client.post("/v1/embeddings", json={"input": ["hello there"]})
            models = client.get("/v1/models").json()
            metrics = client.get("/metrics").text
    finally:
        log = finish_server(server)
    # Slots and context were sized from this machine's memory (sizing.py): 2048 cells per sequence,
    # as many sequences as fit in 1/8 of the available memory, at most 64.
    slots = int(float(re.search(r"^cllm_slots_total\{model=\"[^\"]+\"\} (\S+)$", metrics, re.M).group(1)))
    model = LlamaModelHandle(path=resolve_model_path(None))
    per_token = model.kv_bytes_per_token("f16", "f16")
    model.close()
    fits = [kv_shape(None, None, n_ctx_train=8192, bytes_per_token=per_token, available_bytes=avail)[1]
            for avail in (available_before, available_memory())]
    assert models["data"][0]["max_model_len"] == 2048
    # The server read the memory before its own KV took any, between these two readings: +-2 allows for
    # what else moved meanwhile (the page cache, other processes; a one-sided reading after the run was
    # 3 slots off once on a busy machine).
    low, high = min(MAX_AUTO_SEQS, *fits), min(MAX_AUTO_SEQS, max(fits))
    assert low - 2 <= slots <= high + 2, (slots, fits)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    assert emb.status_code == 200, emb.text
    assert len(emb.json()["data"][0]["embedding"]) == 576  # SmolLM2-135M's hidden size
    assert "Traceback" not in log
