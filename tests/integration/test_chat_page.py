"""The chat page at `/` in a real headless Chromium (Debian's chromium + chromium-driver, through Selenium)
against a real `cllm serve` on the embedded model: a streamed reply, the stop button aborting the request
on the server, model-made markup shown as text, the API-key prompt, and a screenshot as a test artifact
(test-artifacts/ at the repository root, or $CLLM_TEST_ARTIFACTS).

No scripted engine: the injected markup is the real model's output, forced with the server's own
constrained decoding (the `grammar` request field), which the page lets a person add through its
"extra request fields".

The model picker (several models behind one server) runs against a real two-model `cllm serve` (the embedded
GGUF under two names). One test scripts only GET /v1/models and the router's 503 answers in the page's
fetch — a model name full of markup, a model that takes seconds to load, a server with no room — while
the real engine still writes every reply.

Images: picked through the real file input (Selenium send_keys), dropped and pasted as real DataTransfer events,
sent to the tiny LLaVA (cllm/tiny_vlms.py) on the torch backend and to the tiny Gemma 3 GGUF on llama.cpp; refused
in the page (not an image, over 20 MB) and by the server (413 body limit, 400 text-only model).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cllm.model_path import resolve_model_path
from tests.integration.conftest_server import API_KEY, ServerProcess, _finish, start_server

from selenium import webdriver  # the test extra, which `make test` installs: missing is a failure, not a skip
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("CLLM_TEST_ARTIFACTS") or REPO / "test-artifacts")
PAYLOAD = "<img src=x onerror=window.__pwned=1>"
# The model must write the payload, then a bit of markdown: GBNF literal, so the reply is exactly this.
FORCED_REPLY = f"{PAYLOAD} and <b>tag</b> then **bold** and `code`"
FORCED_GRAMMAR = 'root ::= "' + FORCED_REPLY.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    # `make test` installs them (the Makefile's browser target): a missing browser is a failure, never a skip.
    pytest.fail("Debian's chromium and chromium-driver are not installed: run `make browser` (apt-get, as root)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    chromium, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page_server() -> Iterator[ServerProcess]:
    srv = start_server("--n-seq-max", "4", "--n-ctx", "8192", "--log-level", "info")
    yield srv
    _finish(srv)


def _open(driver: webdriver.Chrome, url: str) -> None:
    driver.get(url)
    driver.execute_script("sessionStorage.clear(); localStorage.clear();")
    driver.get(url)  # a fresh conversation and default settings


def _wait(driver: webdriver.Chrome, condition, timeout: float = 60.0, what: str = "") -> object:  # noqa: ANN001
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def _model_shown(driver: webdriver.Chrome) -> str:
    return _wait(driver, lambda d: (t := d.find_element(By.ID, "model-name").text) and t != "connecting…" and t,
                 what="the model name never appeared")


def _settings(driver: webdriver.Chrome, **fields: str) -> None:
    if driver.find_element(By.ID, "settings").get_attribute("hidden") is not None:
        driver.find_element(By.ID, "toggle-settings").click()
    for element_id, value in fields.items():
        box = driver.find_element(By.ID, element_id)
        driver.execute_script("arguments[0].value = arguments[1];", box, value)


def _send(driver: webdriver.Chrome, text: str) -> None:
    box = driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def _last_reply(driver: webdriver.Chrome):  # noqa: ANN202
    return driver.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")[-1]


def _record_stream(driver: webdriver.Chrome) -> None:
    """Note every distinct length the streaming reply's text has (a streamed reply grows in steps)."""
    driver.execute_script("""
        window.__lengths = [];
        new MutationObserver(() => {
          const m = document.querySelectorAll('#messages .msg.assistant');
          const last = m[m.length - 1];
          if (last && last.dataset.state === 'streaming') {
            const n = last.querySelector('.body').textContent.length;
            if (window.__lengths[window.__lengths.length - 1] !== n) window.__lengths.push(n);
          }
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true, attributes: true});
    """)


def _screenshot(driver: webdriver.Chrome, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), f"could not write {path}"
    assert path.stat().st_size > 10_000  # a real picture of the page, not an empty file
    return path


def _engine_idle(server: ServerProcess, timeout_s: float) -> float:
    """Seconds until /v1/engine shows no running or waiting request (AssertionError after timeout_s)."""
    start = time.monotonic()
    with server.http() as http:
        while time.monotonic() - start < timeout_s:
            body = http.get("/v1/engine").json()
            if not body["running"] and not body["stats"]["num_waiting"]:
                return time.monotonic() - start
            time.sleep(0.05)
    raise AssertionError(f"the server still runs the stopped request after {timeout_s}s: {body}")


def _aborted_count(server: ServerProcess) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    # summed over the other labels (a multi-model server labels each request with its model)
    return sum(float(v) for v in re.findall(r'^cllm_requests_total\{(?:[^}]*,)?status="abort"(?:,[^}]*)?\} (\S+)$', text, re.M))


def test_page_is_served_with_a_strict_content_security_policy(page_server: ServerProcess) -> None:
    with httpx.Client(base_url=page_server.base_url) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "static/chat.js" in page.text
        for path in ("/static/chat.js", "/static/chat.css"):
            assert http.get(path).status_code == 200
        # nothing on the page comes from elsewhere
        assert not re.search(r"(src|href)=\"(https?:)?//", page.text)


def test_send_a_message_and_see_a_streamed_reply(browser: webdriver.Chrome, page_server: ServerProcess) -> None:
    _open(browser, page_server.base_url + "/")
    assert _model_shown(browser).startswith("SmolLM2")
    _settings(browser, **{"temperature": "0", "max-tokens": "48", "extra": json.dumps({"ignore_eos": True})})
    _record_stream(browser)
    _send(browser, "Write a short poem about the sea.")
    reply = _wait(browser, lambda d: (r := _last_reply(d)).get_attribute("data-state") == "done" and r,
                  what="the reply never finished")
    text = reply.find_element(By.CSS_SELECTOR, ".body").text
    assert len(text) > 20, text
    lengths = browser.execute_script("return window.__lengths")
    assert len(lengths) >= 3, f"the reply did not stream (text lengths seen while streaming: {lengths})"
    stats = browser.find_element(By.ID, "stats").text
    assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · 48 tokens · length", stats), stats
    user = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user")
    assert [u.find_element(By.CSS_SELECTOR, ".body").text for u in user] == ["Write a short poem about the sea."]
    # the conversation goes on: the second request carries the first turn
    _send(browser, "Again, shorter.")
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 2
          and _last_reply(d).get_attribute("data-state") == "done", what="the second reply never finished")
    history = json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')"))
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    _screenshot(browser, "chat-page.png")


def test_stop_button_aborts_the_request_on_the_server(browser: webdriver.Chrome, page_server: ServerProcess) -> None:
    _open(browser, page_server.base_url + "/")
    _model_shown(browser)
    aborted_before = _aborted_count(page_server)
    # 1500 tokens take tens of seconds here: long enough to be stopped well before the end
    _settings(browser, **{"max-tokens": "1500", "extra": json.dumps({"ignore_eos": True})})
    _send(browser, "Tell me a very long story.")
    _wait(browser, lambda d: len(_last_reply(d).find_element(By.CSS_SELECTOR, ".body").text) > 40,
          what="the long reply never started")
    with page_server.http() as http:
        assert http.get("/v1/engine").json()["running"], "the long reply should be running on the server"
    browser.find_element(By.ID, "stop").click()
    reply = _wait(browser, lambda d: (r := _last_reply(d)).get_attribute("data-state") == "stopped" and r,
                  timeout=10, what="the reply did not stop")
    assert "stopped" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    assert browser.find_element(By.ID, "send").is_displayed()
    assert _engine_idle(page_server, timeout_s=5.0) < 5.0  # aborted, not run to 1500 tokens
    assert _aborted_count(page_server) == aborted_before + 1
    _screenshot(browser, "chat-page-stopped.png")


def test_markup_in_the_reply_is_shown_as_text(browser: webdriver.Chrome, page_server: ServerProcess) -> None:
    _open(browser, page_server.base_url + "/")
    _model_shown(browser)
    _settings(browser, **{"temperature": "0", "max-tokens": "64", "extra": json.dumps({"grammar": FORCED_GRAMMAR})})
    _send(browser, f"Say this: {PAYLOAD}")  # the user's own message carries it too
    reply = _wait(browser, lambda d: (r := _last_reply(d)).get_attribute("data-state") == "done" and r,
                  what="the forced reply never finished")
    body = reply.find_element(By.CSS_SELECTOR, ".body")
    assert PAYLOAD in body.text, body.text  # shown, as text
    assert "<b>tag</b>" in body.text
    assert body.find_elements(By.TAG_NAME, "strong")[0].text == "bold"  # markdown still renders
    assert body.find_elements(By.TAG_NAME, "code")[0].text == "code"
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages img, #messages b")  # no element from the text
    user = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user .body")[-1]
    assert PAYLOAD in user.text
    time.sleep(0.3)  # an onerror would have fired by now
    assert browser.execute_script("return window.__pwned === undefined")
    _screenshot(browser, "chat-page-markup.png")


def test_page_asks_for_the_api_key_and_sends_it(browser: webdriver.Chrome) -> None:
    server = start_server("--n-seq-max", "2", "--n-ctx", "4096", api_key=API_KEY)
    try:
        with httpx.Client(base_url=server.base_url) as http:
            assert http.get("/").status_code == 200  # the page itself is public
            assert http.get("/static/chat.js").status_code == 200
            assert http.get("/v1/models").status_code == 401  # the API is not
        _open(browser, server.base_url + "/")
        _wait(browser, lambda d: d.find_element(By.ID, "api-key-panel").is_displayed(), what="no API-key prompt")
        key_box = browser.find_element(By.ID, "api-key")
        key_box.send_keys("wrong-key")
        browser.find_element(By.ID, "api-key-save").click()
        _wait(browser, lambda d: "refused" in d.find_element(By.ID, "api-key-error").text, what="a wrong key passed")
        key_box.clear()
        key_box.send_keys(API_KEY)
        browser.find_element(By.ID, "api-key-save").click()
        # the name replaces "API key needed" once /v1/models answers with the key (not at once)
        _wait(browser, lambda d: d.find_element(By.ID, "model-name").text.startswith("SmolLM2"),
              what="the model name never appeared with the right key")
        assert not browser.find_element(By.ID, "api-key-panel").is_displayed()
        _settings(browser, **{"max-tokens": "8", "extra": json.dumps({"ignore_eos": True})})
        _send(browser, "Hi")
        reply = _wait(browser, lambda d: (r := _last_reply(d)).get_attribute("data-state") in ("done", "error") and r,
                      what="no reply with the key")
        assert reply.get_attribute("data-state") == "done"
    finally:
        _finish(server)


HOSTILE = "\n".join([
    "# Title <script>window.__pwned=2</script>",
    "[click](javascript:window.__pwned=3) and [ok](https://example.com/a?b=1)",
    "![img](x) <iframe src=x></iframe> <svg onload=window.__pwned=4>",
    "- item **<b>x</b>**",
    "1. one",
    "> quote <img src=x onerror=window.__pwned=5>",
    "```html",
    "<img src=x onerror=window.__pwned=6>",
    "```",
    "`<i>inline</i>` and *em* and snake_case_name",
])


def test_markdown_renderer_builds_text_nodes_only(browser: webdriver.Chrome, page_server: ServerProcess) -> None:
    """The page's renderer on hostile markdown: structure from markdown, never an element from the text."""
    _open(browser, page_server.base_url + "/")
    result = browser.execute_script("""
        const root = document.createElement('div');
        document.body.append(root);
        window.cllmChat.renderMarkdown(arguments[0], root);
        const tags = [...root.querySelectorAll('*')].map((n) => n.tagName.toLowerCase());
        const links = [...root.querySelectorAll('a')].map((a) => a.href);
        return {tags, links, text: root.textContent};
    """, HOSTILE)
    time.sleep(0.3)
    assert browser.execute_script("return window.__pwned === undefined")
    assert set(result["tags"]) <= {"h3", "p", "a", "ul", "ol", "li", "strong", "em", "code", "pre", "blockquote", "br"}
    assert {"h3", "ul", "ol", "strong", "pre", "blockquote", "code", "em"} <= set(result["tags"])
    assert result["links"] == ["https://example.com/a?b=1"]  # the javascript: link stays text
    for raw in ("<script>window.__pwned=2</script>", "[click](javascript:window.__pwned=3)", "<iframe src=x></iframe>",
                "<img src=x onerror=window.__pwned=6>", "<i>inline</i>", "snake_case_name"):
        assert raw in result["text"], raw


def _picker(driver: webdriver.Chrome) -> Select:
    _wait(driver, lambda d: d.find_element(By.ID, "model-picker").is_displayed(), what="no model picker")
    return Select(driver.find_element(By.ID, "model-picker"))


def _record_status(driver: webdriver.Chrome) -> None:
    """Note every text #server-status shows from now on."""
    driver.execute_script("""
        window.__statuses = [];
        const status = document.getElementById('server-status');
        new MutationObserver(() => window.__statuses.push(status.textContent))
          .observe(status, {subtree: true, childList: true, characterData: true});
    """)


def _reply_done(driver: webdriver.Chrome, count: int, timeout: float = 120.0):  # noqa: ANN202
    return _wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == count
                 and (r := _last_reply(d)).get_attribute("data-state") in ("done", "error") and r,
                 timeout=timeout, what=f"reply {count} never finished")


HOSTILE_MODEL = "<img src=x onerror=window.__pwned=7>"
# In the page before its own script: GET v1/models answers a scripted list (alias cards included) whose statuses
# follow the requests; "other" takes 2.5 s to load; "busy" gets the router's 503 model_capacity; every other
# chat request goes on to the real server, `model` left out (it serves one model), and its model is noted.
SCRIPTED_MODELS = """
(() => {
  const realFetch = window.fetch.bind(window);
  const status = {small: 'loaded', other: 'unloaded', busy: 'loaded'};
  status[%(hostile)s] = 'unloaded';
  window.__asked = [];
  const json = (body, code, headers) => new Response(JSON.stringify(body),
      {status: code, headers: Object.assign({'Content-Type': 'application/json'}, headers || {})});
  const card = (id, root) => ({id, object: 'model', created: 0, owned_by: 'cllm', root, status: status[root],
      loaded: status[root] === 'loaded', max_model_len: status[root] === 'loaded' ? 8192 : null, backend: 'llama_cpp'});
  window.fetch = async (url, options) => {
    const path = String(url);
    if (path.endsWith('v1/models')) {
      return json({object: 'list', data: [card('small', 'small'), card('small-alias', 'small'), card('other', 'other'),
                                           card('busy', 'busy'), card(%(hostile)s, %(hostile)s)]}, 200);
    }
    if (path.endsWith('v1/chat/completions')) {
      const body = JSON.parse(options.body);
      window.__asked.push(body.model);
      if (body.model === 'busy') {
        return json({error: {message: "every loaded model is serving requests; retry shortly", type: 'server_error',
                             code: 'model_capacity'}}, 503, {'Retry-After': '5'});
      }
      if (status[body.model] !== 'loaded') {
        status[body.model] = 'loading';
        await new Promise((r) => setTimeout(r, 2500));
        status[body.model] = 'loaded';
      }
      delete body.model;
      return realFetch(url, Object.assign({}, options, {body: JSON.stringify(body)}));
    }
    return realFetch(url, options);
  };
})();
""" % {"hostile": json.dumps(HOSTILE_MODEL)}


def test_model_picker_on_a_scripted_model_list(browser: webdriver.Chrome, page_server: ServerProcess) -> None:
    """Aliases folded away, hostile names as text, "loading MODEL…" while a model loads, the server's 503 words."""
    script = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": SCRIPTED_MODELS})
    try:
        _open(browser, page_server.base_url + "/")
        picker = _picker(browser)
        assert [o.get_attribute("value") for o in picker.options] == ["small", "other", "busy", HOSTILE_MODEL]
        assert [o.text for o in picker.options] == ["small", "other (not loaded)", "busy", f"{HOSTILE_MODEL} (not loaded)"]
        assert picker.first_selected_option.get_attribute("value") == "small"
        assert not browser.find_element(By.ID, "model-name").is_displayed()  # the picker stands in for the badge
        assert not browser.find_elements(By.CSS_SELECTOR, "header img")
        _settings(browser, **{"temperature": "0", "max-tokens": "12", "extra": json.dumps({"ignore_eos": True})})

        picker.select_by_value("other")
        _record_status(browser)
        _send(browser, "Hello there.")
        _wait(browser, lambda d: d.find_element(By.ID, "server-status").text == "loading other…", timeout=5,
              what="no loading note while the model loads")
        reply = _reply_done(browser, 1)
        assert reply.get_attribute("data-state") == "done"
        assert reply.find_element(By.CSS_SELECTOR, ".role").text == "other"
        assert browser.find_element(By.ID, "server-status").text == ""  # cleared once the reply came
        assert "loading other…" in browser.execute_script("return window.__statuses")
        _wait(browser, lambda d: _picker(d).options[1].text == "other", timeout=5, what="the picker still says not loaded")

        picker.select_by_value(HOSTILE_MODEL)  # the name is only ever text, in the picker and on the reply
        _send(browser, "And you?")
        reply = _reply_done(browser, 2)
        assert reply.find_element(By.CSS_SELECTOR, ".role").text == HOSTILE_MODEL
        assert browser.find_element(By.ID, "server-status").text == ""

        picker.select_by_value("busy")
        _send(browser, "Still there?")
        reply = _reply_done(browser, 3)
        assert reply.get_attribute("data-state") == "error"
        note = reply.find_element(By.CSS_SELECTOR, ".error-text").text
        assert note == "503: every loaded model is serving requests; retry shortly (retry in 5 s)", note
        assert browser.execute_script("return window.__asked") == ["other", HOSTILE_MODEL, "busy"]
        history = json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')"))
        assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]  # the 503 left no turn

        picker.select_by_value("other")
        browser.refresh()  # the tab's choice and conversation survive a reload
        assert _picker(browser).first_selected_option.get_attribute("value") == "other"
        roles = [r.text for r in browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant .role")]
        assert roles == ["other", HOSTILE_MODEL]
        time.sleep(0.3)
        assert browser.execute_script("return window.__pwned === undefined")
        assert not browser.find_elements(By.CSS_SELECTOR, "header img, #messages img")
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})


@pytest.fixture(scope="module")
def two_model_server() -> Iterator[ServerProcess]:
    """The embedded GGUF declared twice, as "small" and "other", each loaded on its first request, never unloaded."""
    path = str(resolve_model_path(None))
    srv = start_server("--model", f"small={path}", "--model", f"other={path}", "--set", "keep_alive=-1",
                       "--log-level", "info")
    yield srv
    _finish(srv)


def _statuses(server: ServerProcess) -> dict[str, str]:
    with server.http() as http:
        cards = http.get("/v1/models").json()["data"]
    return {c["id"]: c["status"] for c in cards if c.get("root", c["id"]) == c["id"]}


def test_model_picker_on_a_two_model_server(browser: webdriver.Chrome, two_model_server: ServerProcess) -> None:
    _open(browser, two_model_server.base_url + "/")
    picker = _picker(browser)
    assert sorted(o.get_attribute("value") for o in picker.options) == ["other", "small"]
    before = _statuses(two_model_server)
    for option in picker.options:  # each model once, its status said while it is not loaded
        name = option.get_attribute("value")
        assert option.text == (name if before[name] == "loaded" else f"{name} (not loaded)"), option.text
    assert before["other"] != "loaded"
    _settings(browser, **{"temperature": "0", "max-tokens": "24", "extra": json.dumps({"ignore_eos": True})})

    picker.select_by_value("other")
    assert browser.execute_script("return sessionStorage.getItem('cllm.chat.model')") == "other"
    _record_status(browser)
    _record_stream(browser)
    _send(browser, "Write a short poem about the sea.")
    reply = _reply_done(browser, 1)
    assert reply.get_attribute("data-state") == "done", reply.text
    assert reply.find_element(By.CSS_SELECTOR, ".role").text == "other"
    assert len(reply.find_element(By.CSS_SELECTOR, ".body").text) > 10
    assert len(browser.execute_script("return window.__lengths")) >= 3  # streamed
    assert "loading other…" in browser.execute_script("return window.__statuses")
    assert browser.find_element(By.ID, "server-status").text == ""
    after = _statuses(two_model_server)
    assert after["other"] == "loaded", after
    assert after["small"] == before["small"], after  # only the chosen model was loaded
    _wait(browser, lambda d: _picker(d).first_selected_option.text == "other", timeout=5,
          what="the picker still says other is not loaded")

    browser.refresh()  # the tab remembers the choice, and the conversation
    picker = _picker(browser)
    assert picker.first_selected_option.get_attribute("value") == "other"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 1

    picker.select_by_value("small")  # switching keeps the conversation: the next request carries it all
    _send(browser, "Again, shorter.")
    reply = _reply_done(browser, 2)
    assert reply.get_attribute("data-state") == "done", reply.text
    assert reply.find_element(By.CSS_SELECTOR, ".role").text == "small"
    history = json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')"))
    assert [(m["role"], m.get("model")) for m in history] == [
        ("user", None), ("assistant", "other"), ("user", None), ("assistant", "small")]
    assert _statuses(two_model_server) == {"small": "loaded", "other": "loaded"}
    _screenshot(browser, "chat-page-model-picker.png")


@pytest.fixture(scope="module")
def vision_server() -> Iterator[ServerProcess]:
    """The tiny Gemma 3 VLM GGUF with its projector beside it (tests/assets/models)."""
    srv = start_server("--model", str(REPO / "tests" / "assets" / "models" / "tiny-gemma3-f32.gguf"),
                       "--n-seq-max", "2", "--n-ctx", "4096", "--speculative", "off")
    yield srv
    _finish(srv)


def test_attach_an_image_send_it_and_refuse_a_non_image(browser: webdriver.Chrome, vision_server: ServerProcess,
                                                        tmp_path: Path) -> None:
    from cllm import tiny_vlms

    picture = tmp_path / "picture.png"
    tiny_vlms.sample_image("gemma3").save(picture)
    notes = tmp_path / "notes.txt"
    notes.write_text("not an image")
    _open(browser, vision_server.base_url + "/")
    _model_shown(browser)
    _settings(browser, **{"temperature": "0", "max-tokens": "6"})
    chooser = browser.find_element(By.ID, "image-input")
    chooser.send_keys(str(notes))  # refused in the page, nothing attached
    _wait(browser, lambda d: "not a PNG, JPEG, WebP or GIF" in d.find_element(By.ID, "attach-error").text,
          what="a text file was not refused")
    assert browser.find_elements(By.CSS_SELECTOR, "#attachments img") == []
    chooser.send_keys(str(picture))
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")) == 1,
          what="the picked image shows no thumbnail")
    _send(browser, "What is in the picture?")
    reply = _wait(browser, lambda d: (r := _last_reply(d)).get_attribute("data-state") in ("done", "error") and r,
                  what="the reply never finished")
    assert reply.get_attribute("data-state") == "done", reply.text
    assert browser.find_elements(By.CSS_SELECTOR, "#attachments img") == []  # sent with that message only
    user = browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user")[-1]
    assert user.find_element(By.CSS_SELECTOR, "img.thumb").get_attribute("src").startswith("data:image/png;base64,")
    history = json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')"))
    parts = history[0]["content"]
    assert parts[0] == {"type": "text", "text": "What is in the picture?"}
    assert parts[1]["type"] == "image_url" and parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert re.search(r"6 tokens · length", browser.find_element(By.ID, "stats").text)
    # the image is in the prompt the server counted: the engine saw <start_of_image> + 16 + <end_of_image>
    with vision_server.http() as http:
        assert http.get("/v1/engine").json()["stats"]["prompt_tokens_total"] > 18
    _screenshot(browser, "chat-page-image.png")


# ---------------------------------------------------------------------------------------------- images

# Every chat request the page sends, as the JSON it sent (installed after the page loaded; the page calls the
# global fetch at each request).
RECORD_REQUESTS = """
  window.__sent = [];
  const realFetch = window.fetch.bind(window);
  window.fetch = (url, options) => {
    if (String(url).endsWith('v1/chat/completions')) window.__sent.push(JSON.parse(options.body));
    return realFetch(url, options);
  };
"""

# Hands files to the page as a drop on the conversation (arguments: event, [[name, type, base64 | size]]):
# a real DataTransfer of real File objects, as a drag from the desktop gives.
DISPATCH_FILES = """
  const [kind, specs] = arguments;
  const dt = new DataTransfer();
  for (const [name, type, b64, size] of specs) {
    const bytes = b64 !== null ? Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)) : new Uint8Array(size);
    dt.items.add(new File([bytes], name, {type}));
  }
  const init = {bubbles: true, cancelable: true};
  const event = kind === 'paste' ? new ClipboardEvent('paste', Object.assign({clipboardData: dt}, init))
                                 : new DragEvent(kind, Object.assign({dataTransfer: dt}, init));
  const target = kind === 'paste' ? document.getElementById('input') : document.getElementById('messages');
  return target.dispatchEvent(event);  // false: the page took the event (the browser does not open the file)
"""


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny random LLaVA (cllm/tiny_vlms.py: CLIP tower, 16 image tokens) on the torch backend, float32;
    bodies up to 32 MiB (the default 1 MiB would refuse the multi-megabyte image below)."""
    from cllm import tiny_vlms

    model = tiny_vlms.build_tiny_vlm("llava", tmp_path_factory.mktemp("tiny-llava") / "tiny-llava")
    srv = start_server("--backend", "torch", "--model", str(model), "--set", "dtype=float32",
                       "--set", f"max_body_bytes={32 << 20}", "--n-seq-max", "2", "--n-ctx", "4096", "--speculative", "off", "--log-level", "info")
    yield srv
    _finish(srv)


def _png(family: str, seed: int, path: Path) -> Path:
    from cllm import tiny_vlms

    tiny_vlms.sample_image(family, seed=seed).save(path)
    return path


def _noise_png(path: Path, side: int) -> Path:
    """An incompressible PNG: side * side * 3 bytes and a little more."""
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB").save(path)
    return path


def _thumbs(driver: webdriver.Chrome, css: str = "#attachments img.thumb") -> list[str]:
    return [img.get_attribute("src") for img in driver.find_elements(By.CSS_SELECTOR, css)]


def _data_url(path: Path, media_type: str = "image/png") -> str:
    import base64

    return f"data:{media_type};base64," + base64.b64encode(path.read_bytes()).decode()


def test_images_picked_removed_sent_and_kept_on_a_llava_server(browser: webdriver.Chrome, llava_server: ServerProcess,
                                                               tmp_path: Path) -> None:
    """Two images picked with the file button, one removed with ×; the message goes as text + image_url parts
    (the request the page sent, replayed: the server counts the image's 16 tokens); the user's bubble shows the
    image; the tiny LLaVA answers; the next turn carries the image again in its history."""
    first, second = _png("llava", 0, tmp_path / "first.png"), _png("llava", 1, tmp_path / "second.png")
    _open(browser, llava_server.base_url + "/")
    _model_shown(browser)
    browser.execute_script(RECORD_REQUESTS)
    _settings(browser, **{"temperature": "0", "max-tokens": "4", "extra": json.dumps({"ignore_eos": True})})
    browser.find_element(By.ID, "image-input").send_keys(f"{first}\n{second}")  # two files in one pick
    _wait(browser, lambda d: len(_thumbs(d)) == 2, what="the two picked images show no thumbnails")
    assert _thumbs(browser) == [_data_url(first), _data_url(second)]  # in the order picked
    browser.find_elements(By.CSS_SELECTOR, "#attachments .remove")[1].click()
    assert _thumbs(browser) == [_data_url(first)]

    _send(browser, "What is in the picture?")
    reply = _reply_done(browser, 1)
    assert reply.get_attribute("data-state") == "done", reply.text
    assert re.search(r"4 tokens · length", browser.find_element(By.ID, "stats").text)
    assert _thumbs(browser) == []  # the image went with that message
    assert _thumbs(browser, "#messages .msg.user img.thumb") == [_data_url(first)]
    assert browser.find_element(By.CSS_SELECTOR, "#messages .msg.user .body").text.startswith("What is in the picture?")
    sent = browser.execute_script("return window.__sent")
    assert sent[0]["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": _data_url(first)}}]}]

    _send(browser, "And now?")  # the image stays in the history sent with later turns
    assert _reply_done(browser, 2).get_attribute("data-state") == "done"
    sent = browser.execute_script("return window.__sent")
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][0] == sent[0]["messages"][0] and sent[1]["messages"][2]["content"] == "And now?"

    # The server reads the page's image: the same request without it is 16 image tokens (+ the template's
    # newline after <image>) shorter.
    body = {**sent[0], "stream": False, "max_tokens": 1}
    body.pop("stream_options")
    text_only = {**body, "messages": [{"role": "user", "content": "What is in the picture?"}]}
    with llava_server.http() as http:
        with_image, without = (http.post("/v1/chat/completions", json=b).json()["usage"]["prompt_tokens"]
                               for b in (body, text_only))
    assert with_image - without == 17, (with_image, without)
    browser.refresh()  # the conversation, images included, survives a reload
    assert _thumbs(browser, "#messages .msg.user img.thumb") == [_data_url(first)]
    _screenshot(browser, "chat-page-image-llava.png")

    # An image past the tab's storage quota (~10 MB of base64 here): sent, answered, kept in this tab; the stored
    # conversation has a note in its place (and keeps the small one), which is what a reload shows.
    browser.execute_script(RECORD_REQUESTS)
    huge = _noise_png(tmp_path / "noise.png", 1800)
    browser.find_element(By.ID, "image-input").send_keys(str(huge))
    _wait(browser, lambda d: len(_thumbs(d)) == 1, what="the large image shows no thumbnail")
    _send(browser, "And this one?")
    assert _reply_done(browser, 3).get_attribute("data-state") == "done"
    _send(browser, "Still there?")  # the large image goes again with the next turn: the tab kept it
    assert _reply_done(browser, 4).get_attribute("data-state") == "done"
    sent = browser.execute_script("return window.__sent")
    assert sent[1]["messages"][4]["content"][1]["image_url"]["url"] == _data_url(huge)
    stored = json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')"))
    assert stored[0]["content"][1]["image_url"]["url"] == _data_url(first)
    assert stored[4]["content"][0] == {"type": "text", "text": "And this one?"}
    assert "image not kept across a reload" in stored[4]["content"][1]["text"]
    browser.refresh()
    assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")) == 4
    assert _thumbs(browser, "#messages .msg.user img.thumb") == [_data_url(first)]
    assert "image not kept across a reload" in browser.find_elements(By.CSS_SELECTOR, "#messages .msg.user")[2].text


def test_dropped_and_pasted_images_and_refused_files(browser: webdriver.Chrome, page_server: ServerProcess,
                                                     tmp_path: Path) -> None:
    """A drop anywhere on the page and a paste into the message box attach images; a non-image (picked or
    dropped) and a file over 20 MB are refused with a message and attach nothing."""
    import base64

    png = base64.b64encode(_png("llava", 2, tmp_path / "p.png").read_bytes()).decode()
    _open(browser, page_server.base_url + "/")
    _model_shown(browser)
    error = lambda d: d.find_element(By.ID, "attach-error").text  # noqa: E731
    (tmp_path / "notes.txt").write_text("not an image")
    browser.find_element(By.ID, "image-input").send_keys(str(tmp_path / "notes.txt"))
    _wait(browser, lambda d: error(d) == "notes.txt: not a PNG, JPEG, WebP or GIF image", timeout=5,
          what="a picked text file was not refused")
    assert browser.find_element(By.ID, "attach-error").is_displayed()
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:
        f.truncate(20 * 1024 * 1024 + 1)  # sparse: named and typed as a PNG, one byte over the limit
    browser.find_element(By.ID, "image-input").send_keys(str(big))
    _wait(browser, lambda d: error(d) == "huge.png: larger than 20 MB", timeout=5, what="a 20 MB + 1 file was not refused")
    assert _thumbs(browser) == []

    assert browser.execute_script(DISPATCH_FILES, "drop", [["dropped.png", "image/png", png, 0],
                                                           ["dropped.pdf", "application/pdf", None, 10]]) is False
    _wait(browser, lambda d: len(_thumbs(d)) == 1, timeout=5, what="the dropped image shows no thumbnail")
    assert error(browser) == "dropped.pdf: not a PNG, JPEG, WebP or GIF image"
    assert browser.execute_script(DISPATCH_FILES, "paste", [["", "image/png", png, 0]]) is False
    _wait(browser, lambda d: len(_thumbs(d)) == 2, timeout=5, what="the pasted image shows no thumbnail")
    assert error(browser) == ""  # a new batch clears the last refusal
    assert browser.current_url.startswith(page_server.base_url)  # the drop did not navigate away
    assert browser.find_element(By.CSS_SELECTOR, "#attachments .remove").get_attribute("title") == "remove dropped.png"


def test_a_text_only_model_refuses_the_image_and_the_page_says_so(browser: webdriver.Chrome,
                                                                   page_server: ServerProcess, tmp_path: Path) -> None:
    """The embedded text model answers an image with its 400: shown under the reply as other errors are; the
    message leaves the history and its image goes back to the composer (to remove, or send to another model).
    Before that, an image larger than the server's body limit (1 MiB by default) gets its 413 and a hint."""
    picture = _png("llava", 0, tmp_path / "picture.png")
    _open(browser, page_server.base_url + "/")
    _model_shown(browser)
    _settings(browser, **{"max-tokens": "4"})
    browser.find_element(By.ID, "image-input").send_keys(str(_noise_png(tmp_path / "big.png", 700)))
    _wait(browser, lambda d: len(_thumbs(d)) == 1, timeout=5, what="no thumbnail")
    _send(browser, "Big picture")
    reply = _reply_done(browser, 1)
    note = reply.find_element(By.CSS_SELECTOR, ".error-text").text
    assert note.startswith("413: request body exceeds the server's limit of 1048576 bytes"), note
    assert "--set max_body_bytes=N" in note
    browser.find_element(By.CSS_SELECTOR, "#attachments .remove").click()
    browser.find_element(By.ID, "image-input").send_keys(str(picture))
    _wait(browser, lambda d: len(_thumbs(d)) == 1, timeout=5, what="no thumbnail")
    browser.find_element(By.ID, "input").clear()
    browser.find_element(By.ID, "send").click()  # an image alone, no text, is a message too
    reply = _reply_done(browser, 2)
    assert reply.get_attribute("data-state") == "error"
    note = reply.find_element(By.CSS_SELECTOR, ".error-text").text
    assert note.startswith("400: ") and "does not accept images" in note, note
    assert _thumbs(browser) == [_data_url(picture)]
    assert _thumbs(browser, "#messages .msg.user img.thumb")[-1] == _data_url(picture)  # still in its bubble
    assert json.loads(browser.execute_script("return sessionStorage.getItem('cllm.chat.messages')")) == []
