"""use_beam_search on /v1/completions and /v1/chat/completions: the server's beams are the offline
LLM.beam_search's (tests/engine/test_beam_search.py holds those against transformers); a stream or logprobs
with it is a 400."""

from __future__ import annotations

import openai
import pytest

from heron.sampling_params import BeamSearchParams
from tests.entrypoints.openai.remote_server import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_completion_beams_are_the_offline_beams(client, embedded_llm):
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, n=2, extra_body={"use_beam_search": True, "length_penalty": 0.5}
    )
    (offline,) = embedded_llm.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=0.5))
    tok = embedded_llm.get_tokenizer()
    n = len(tok(PROMPT).input_ids)
    expected = [tok.decode(s.tokens[n:], skip_special_tokens=True) for s in offline.sequences]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == expected
    assert out.usage.completion_tokens == sum(len(s.tokens) - n for s in offline.sequences)


def test_chat_beams_and_refusals(client):
    messages = [{"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, n=3, extra_body={"use_beam_search": True}
    )
    assert len(out.choices) == 3 and all(c.message.content for c in out.choices)
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": True}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, extra_body={"use_beam_search": True}, **extra
            )
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, n=11, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "n"
