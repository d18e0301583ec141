"""Issue 46 §5/§6 through `cllm serve` on the embedded model: --chat-template replaces the model's
template; continue_final_message continues the last assistant message; `serve --help` reads right."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from cllm.cli import app
from tests.integration.conftest_server import ServerProcess, finish_server, start_server

# ChatML as SmolLM2's, with a marker the model's own template never writes.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\nCUSTOM: {% endif %}")
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."},
         {"role": "assistant", "content": "1, 2, 3, 4,"}]


@pytest.fixture(scope="module", params=["off", "on"])
def srv(request, tmp_path_factory) -> Iterator[ServerProcess]:
    """The server in-process and with the engine core in its own process (whose API side tokenises)."""
    path = tmp_path_factory.mktemp("template") / "chatml-custom.jinja"
    path.write_text(TEMPLATE)
    server = start_server("--chat-template", str(path), "--set", f"engine_process={request.param}")
    yield server
    finish_server(server)


def _ids(client, **body) -> list[int]:
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_chat_template_file_replaces_the_models(srv):
    with srv.http() as client:
        chat = _ids(client, messages=COUNT[:1])
        expected = _ids(client, prompt="<|im_start|>user\nCount from 1 to 10, separated by commas.<|im_end|>\n"
                                       "<|im_start|>assistant\nCUSTOM: ", add_special_tokens=False)
    assert chat == expected


def test_continue_final_message_continues_the_assistant_text(srv):
    with srv.http() as client:
        response = client.post("/v1/chat/completions", json={
            "messages": COUNT, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 6, "temperature": 0})
        assert response.status_code == 200, response.text
        prompt = _ids(client, prompt="<|im_start|>user\nCount from 1 to 10, separated by commas.<|im_end|>\n"
                                     "<|im_start|>assistant\n1, 2, 3, 4,", add_special_tokens=False)
        new_turn = client.post("/v1/chat/completions", json={"messages": COUNT, "max_tokens": 1, "temperature": 0})
    # the prompt ends inside the assistant's text: no <|im_end|>, no new assistant turn
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)
    assert new_turn.json()["usage"]["prompt_tokens"] > len(prompt)
    assert " 5" in response.json()["choices"][0]["message"]["content"]  # greedy SmolLM2 counts on


def test_continue_final_message_with_a_generation_prompt_is_a_400(srv):
    with srv.http() as client:
        response = client.post("/v1/chat/completions", json={
            "messages": COUNT, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 2})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"]


def test_serve_help_names_the_ray_extra_and_the_speculative_default():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert result.exit_code == 0
    assert "needs cllm[ray]" in result.output
    assert "n-gram on llama.cpp" in result.output and "off until measured" not in result.output
    assert "--chat-template" in result.output
