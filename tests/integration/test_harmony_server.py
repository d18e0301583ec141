"""gpt-oss's harmony channels through a real `cllm serve --backend torch`, on a tiny gpt-oss-flavoured
model: the embedded SmolLM2 tokenizer with harmony's special tokens added (``<|channel|>`` …, control
tokens, ``<|return|>`` / ``<|call|>`` its end tokens, as gpt-oss's), gpt-oss's own chat template, and
a seeded random 2-layer Llama over that vocabulary.

A random model writes no harmony by itself, so each test makes it, two honest ways:
- the real control tokens, by sampling: ``logit_bias`` puts the wanted tokens far above every other
  (100, 99.85, 99.7 …, in order), and ``frequency_penalty`` + ``presence_penalty`` (4 in all) push each
  one below the rest once written, so greedy decoding writes exactly that sequence of distinct tokens
  (the model's own logits are tiny: initializer_range 0.002). The engine samples, detokenizes and
  stops as for any request; only a distinct-token reply can be made so (analysis then final repeats
  ``<|channel|>``), which covers a final answer, a tool call and an analysis cut off by max_tokens.
- the whole reply, by the server's structured output (``guided_regex``): the grammar cannot write
  control tokens (they are no text to it), so the markers come as ordinary tokens ("<", "|",
  "channel" …) that spell the same text, split across many deltas; this makes analysis + final and
  analysis + a tool call.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cllm.tiny_models import smollm2_tokenizer_dir
from tests.integration.conftest_server import ServerProcess, finish_server, start_server

ROOT = Path(__file__).resolve().parents[2]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
STEP = 0.15  # logit_bias step between consecutive wanted tokens; 20 tokens span 2.85 < the penalties' 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-gpt-oss")
    tok = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))  # the embedded model's tokenizer
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.eos_token = "<|return|>"
    tok.chat_template = (ROOT / "tests/assets/chat_templates/openai-gpt-oss-120b.jinja").read_text()
    tok.save_pretrained(path)
    ends = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]  # gpt-oss's generation_config
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=(len(tok) + 63) // 64 * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.002, tie_word_embeddings=False, eos_token_id=ends)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    srv = start_server("--model", str(model_dir), "--backend", "torch", "--n-seq-max", "2", "--n-ctx", "4096",
                       "--speculative", "off", "--set", "dtype=float32", "--log-level", "info")
    yield srv
    finish_server(srv)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _forcing(tokenizer, text: str) -> dict:
    """Sampling fields that make greedy decoding write ``text``'s tokens (all distinct), in order."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(set(ids)) == len(ids) and len(ids) * STEP < 4, f"not a distinct-token reply: {ids}"
    assert tokenizer.decode(ids) == text
    return {"logit_bias": {str(t): 100 - STEP * i for i, t in enumerate(ids)}, "frequency_penalty": 2,
            "presence_penalty": 2, "temperature": 0}


def _chat(server: ServerProcess, **body) -> dict:
    with server.http(timeout=120) as client:
        response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _chat_stream(server: ServerProcess, **body) -> tuple[str, str, list[dict], str | None, int]:
    """(reasoning, content, tool-call fragments, finish_reason, number of content/reasoning deltas)."""
    reasoning = content = ""
    calls: list[dict] = []
    finish = None
    deltas = 0
    with server.http(timeout=120) as client, client.stream(
            "POST", "/v1/chat/completions", json={"messages": MESSAGES, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                delta = choice["delta"]
                piece = delta.get("content") or ""
                assert "<|" not in piece and "|>" not in piece, piece  # no piece of a marker, ever
                content += piece
                reasoning += delta.get("reasoning_content") or ""
                deltas += bool(piece or delta.get("reasoning_content"))
                calls += delta.get("tool_calls") or []
                finish = choice.get("finish_reason") or finish
    return reasoning, content, calls, finish, deltas


# ---- the real control tokens, sampled --------------------------------------------------------


def test_final_channel_from_control_tokens(server, tokenizer):
    forcing = _forcing(tokenizer, "<|channel|>final<|message|>Hello world<|return|>")
    choice = _chat(server, max_tokens=16, **forcing)
    assert choice["message"]["content"] == "Hello world" and choice["finish_reason"] == "stop"
    assert choice["message"].get("reasoning_content") is None
    assert _chat_stream(server, max_tokens=16, **forcing)[:4] == ("", "Hello world", [], "stop")
    # the same tokens through completions (no harmony reading): control tokens are dropped, as always
    with server.http(timeout=120) as client:
        prompt = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        done = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, **forcing}).json()
    assert done["choices"][0]["text"] == "finalHello world"


def test_tool_call_from_control_tokens(server, tokenizer):
    forcing = _forcing(tokenizer, '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>'
                                  '{"city":"Paris"}<|call|>')
    choice = _chat(server, max_tokens=32, tools=[WEATHER], **forcing)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    reasoning, content, calls, finish, _ = _chat_stream(server, max_tokens=32, tools=[WEATHER], **forcing)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}


def test_analysis_cut_off_by_max_tokens(server, tokenizer):
    forcing = _forcing(tokenizer, "<|channel|>analysis<|message|>Need the weather first")
    choice = _chat(server, max_tokens=5, **forcing)  # <|channel|> analysis <|message|> Need " the"
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] == "Need the" and choice["message"]["content"] == ""
    assert _chat_stream(server, max_tokens=5, **forcing)[:4] == ("Need the", "", [], "length")


# ---- a whole reply by structured output: the markers as ordinary tokens -----------------------

ANALYSIS_FINAL = ("<|channel|>analysis<|message|>The user asks about the weather.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.")
ANALYSIS_CALL = ('<|channel|>analysis<|message|>Call the weather tool.<|end|><|start|>assistant'
                 '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def test_analysis_then_final_by_regex(server):
    body = {"guided_regex": re.escape(ANALYSIS_FINAL), "max_tokens": 400, "temperature": 0}
    choice = _chat(server, **body)
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == "The user asks about the weather."
    assert choice["message"]["content"] == "It is sunny in Paris."
    reasoning, content, calls, finish, deltas = _chat_stream(server, **body)
    assert (reasoning, content, calls, finish) == ("The user asks about the weather.", "It is sunny in Paris.", [], "stop")
    assert deltas > 4  # streamed in pieces, while the markers' own pieces were held back


def test_analysis_then_tool_call_by_regex(server):
    body = {"guided_regex": re.escape(ANALYSIS_CALL), "max_tokens": 400, "temperature": 0, "tools": [WEATHER]}
    choice = _chat(server, **body)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "Call the weather tool."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    reasoning, content, calls, finish, _ = _chat_stream(server, **body)
    assert (reasoning, content, finish) == ("Call the weather tool.", "", "tool_calls")
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}


def test_text_before_any_header_is_the_answer(server):
    choice = _chat(server, guided_regex=re.escape("Sunny, 24 degrees."), max_tokens=64, temperature=0)
    assert choice["message"]["content"] == "Sunny, 24 degrees." and choice["message"].get("reasoning_content") is None

