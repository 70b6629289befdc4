"""/playground in a real headless Chromium (Debian's `chromium`, driven over the DevTools protocol): the page asks
for the server's API key, streams a Korean chat answer equal to the API's own, and Stop aborts the request on the
server. The screenshot is saved under the test's tmp dir (its path is printed). `.ci/run` installs chromium;
without it the browser test is skipped and says so."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.entrypoints.openai.cdp import Browser, chromium_binary
from tests.entrypoints.openai.remote_server import API_KEY, MODEL

pytestmark = pytest.mark.slow

SYSTEM = "당신은 친절한 도우미입니다."  # "You are a kind assistant."
QUESTION = "안녕하세요! 서울에 대해 한 문장으로 알려 주세요."  # "Hello! Tell me about Seoul in one sentence."
ABORTED = "heron:request_success_total{finished_reason=abort}"


def test_the_page_is_one_offline_file_linked_from_the_root(server):
    html = httpx.get(f"{server.url}/playground").text
    assert "<script" in html and not re.search(r"""(src|href)=["']?https?://""", html)
    assert "href=/playground" in httpx.get(f"{server.url}/").text


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    b = Browser(binary)
    yield b
    b.close()


def _fill(browser: Browser, **values) -> None:
    for element_id, value in values.items():
        browser.eval(f"document.getElementById({json.dumps(element_id)}).value = {json.dumps(value)}")


def _send(browser: Browser, text: str) -> None:
    _fill(browser, input=text)
    browser.eval("document.getElementById('form').requestSubmit()")


def test_chat_streams_and_stop_aborts(server, browser, tmp_path):
    status = "document.getElementById('status').textContent"
    browser.navigate(f"{server.url}/playground")
    browser.wait_for("document.getElementById('keybox').style.display === 'block'")  # the server has a key
    _fill(browser, apikey=API_KEY)
    browser.eval("document.getElementById('savekey').click()")
    browser.wait_for("document.getElementById('model').options.length > 0")
    assert browser.eval("document.getElementById('model').value") == MODEL

    _fill(browser, system=SYSTEM, temperature="0", max_tokens="12")
    _send(browser, QUESTION)
    done = browser.wait_for(f"{status}.startsWith('Done') && {status}", timeout=20)
    assert re.search(r"12 tokens, [\d.]+ tokens/s", done), done
    shown = browser.eval("[...document.querySelectorAll('.msg')].map((m) => m.textContent)")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    api = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert shown == [QUESTION, api["choices"][0]["message"]["content"]]

    before = server.metrics().get(ABORTED, 0)
    _fill(browser, max_tokens="800")
    _send(browser, "더 길게 설명해 주세요.")  # "Explain at length."
    browser.wait_for(f"/Generating: [0-9.]+ tokens\\/s/.test({status})", timeout=20)  # a few tokens in
    browser.eval("document.getElementById('stop').click()")
    stopped = browser.wait_for(f"{status}.startsWith('Stopped') && {status}")
    deadline = time.monotonic() + 10
    while server.metrics().get(ABORTED, 0) <= before:  # the server saw the client go and aborted the request
        assert time.monotonic() < deadline, "the server did not abort the request"
        time.sleep(0.1)
    assert re.search(r"Stopped: \d+ tokens, [\d.]+ tokens/s", stopped), stopped
    assert browser.eval("document.getElementById('send').disabled") is False
    shot = browser.screenshot(tmp_path / "playground.png")
    assert shot.stat().st_size > 10_000
    print(f"playground screenshot: {shot}")
