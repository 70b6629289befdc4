"""IncrementalDetokenizer and StopChecker against the embedded model's real tokenizer (SmolLM2: GPT-2 style
byte-level BPE, which splits Korean, CJK and emoji into byte tokens). CPU only, no model weights."""

from __future__ import annotations

import os
import random

import pytest

from heron.engine.detokenizer import (
    MAX_PENDING_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopChecker,
    _decodes_through_backend,
)

MULTIBYTE = "안녕하세요 👋🏽 世界"
TEXTS = [
    MULTIBYTE,
    "Hello, world! The answer is 42.\n\n  Indented  code:\tx = {'a': 1}",
    "👨‍👩‍👧‍👦 family, 🇰🇷 flag, ❤️ heart",
    "naïve café — “quotes” Ünïcödé ñ",
    "日本語のテキストと한국어 텍스트, mixed with English.",
    " leading space and trailing space ",
    "a😀b😀😀c",
]


@pytest.fixture(scope="session")
def tok():
    from transformers import AutoTokenizer

    from heron.models.loader import embedded_model_path

    try:
        path = embedded_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="session")
def prompt(tok):
    return tok.apply_chat_template(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt, ids, chunk=1, **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    pieces = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.flush())
    return detok, pieces


def test_tokenizer_splits_multibyte_characters(tok):
    """The premise of the multi-byte tests: some tokens of this text are bare parts of a character."""
    ids = enc(tok, MULTIBYTE)
    assert sum(tok.decode([i]) == REPLACEMENT_CHAR for i in ids) >= 5
    assert tok.decode(ids) == MULTIBYTE


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_pieces_are_whole_characters_and_add_up_to_decode(tok, prompt, text, chunk):
    ids = enc(tok, text)
    detok, pieces = stream(tok, prompt, ids, chunk=chunk)
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=True) == text
    assert pieces[-1] == ""  # valid text: nothing left for flush


def test_incomplete_character_is_held_then_released(tok, prompt):
    ids = enc(tok, "세")  # three byte tokens
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, prompt)
    assert [detok.step([i]) for i in ids] == ["", "", "세"]


@pytest.mark.parametrize("prompt_ids", [[], "chat"])
def test_without_or_with_prompt_context(tok, prompt, prompt_ids):
    prompt_ids = prompt if prompt_ids == "chat" else prompt_ids
    ids = enc(tok, " Paris is the capital of France. 파리")
    detok, pieces = stream(tok, prompt_ids, ids)
    assert pieces[0] == " Paris"  # the leading space of the first token is kept
    assert detok.text == tok.decode(ids)


def test_random_multilingual_text(tok, prompt):
    rng = random.Random(0)
    ranges = [
        (0x20, 0x7E),
        (0xC0, 0x17F),
        (0x3040, 0x30FF),
        (0x4E00, 0x9FFF),
        (0xAC00, 0xD7A3),
        (0x1F300, 0x1F64F),
        (0x1F900, 0x1F9FF),
    ]
    for _ in range(30):
        text = "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40)))
        ids = enc(tok, text)
        detok, pieces = stream(tok, prompt, ids)
        assert not any(REPLACEMENT_CHAR in p for p in pieces), text
        assert detok.text == tok.decode(ids) == text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_special_tokens(tok, prompt, skip, spaces):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = enc(tok, "Hi 👋") + [im_end] + enc(tok, "\nmore")
    detok, pieces = stream(tok, prompt, ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    assert ("<|im_end|>" in detok.text) is not skip
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_output_ending_mid_character_is_flushed_as_decode_shows_it(tok, prompt):
    ids = enc(tok, "OK 世界")[:-1]  # the last character lacks its last byte
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step([i]) for i in ids]
    assert not any(REPLACEMENT_CHAR in p for p in pieces)
    assert "".join(pieces) == "OK 世"
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == tok.decode(ids) == "OK 世" + REPLACEMENT_CHAR
    assert detok.flush() == ""


def test_prompt_ending_mid_character_is_not_completed_by_the_output(tok):
    ids = enc(tok, "世")
    detok, _ = stream(tok, enc(tok, "Hi ") + ids[:1], ids[1:])
    assert detok.text == tok.decode(ids[1:])


def test_invalid_bytes_keep_the_window_bounded(tok, prompt):
    """A model that emits only continuation bytes never completes a character; the window must not grow."""
    lone = enc(tok, "세")[1]  # a continuation byte on its own
    ids = enc(tok, "x") + [lone] * 200 + enc(tok, " y")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = []
    for i in ids:
        pieces.append(detok.step([i]))
        assert len(detok._window) <= 2 * MAX_PENDING_TOKENS + 2
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tok.decode(ids)


# ---- the fast path: decoding through the Rust tokenizer ----


class SlowDecode:
    """A tokenizer that only has `decode`: the detokenizer must call it (the behaviour before the fast path)."""

    def __init__(self, tok) -> None:
        self.decode = tok.decode


def word_tokenizer(clean_up: bool):
    """A word-level fast tokenizer like the benchmarks' (benchmarks/shapes.py), with punctuation words that
    `clean_up_tokenization_spaces` rewrites (" ." -> ".", " n't" -> "n't")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(50)] + [".", ",", "n't", "'s", "?", "<s>", "</s>"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=clean_up
    )


def pieces_both_ways(tok, prompt_ids, ids, **kw) -> tuple[list[str], list[str]]:
    """One stream through `tok` as the detokenizer takes it, one forced through `tok.decode`."""
    return stream(tok, prompt_ids, ids, **kw)[1], stream(SlowDecode(tok), prompt_ids, ids, **kw)[1]


@pytest.mark.parametrize("skip", [True, False])
def test_embedded_tokenizer_decodes_through_its_backend_with_the_same_pieces(tok, prompt, skip):
    assert _decodes_through_backend(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        ids = enc(tok, text) + [im_end] + enc(tok, " 👋 more")
        fast, slow = pieces_both_ways(tok, prompt, ids, skip_special_tokens=skip)
        assert fast == slow
        assert "".join(fast) == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("clean_up", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_word_level_tokenizer_pieces_equal_decode(clean_up, skip):
    tok = word_tokenizer(clean_up)
    assert _decodes_through_backend(tok) is not clean_up
    rng = random.Random(0)
    prompt_ids = [tok.bos_token_id] + [rng.randrange(50) for _ in range(8)]
    ids = [rng.randrange(len(tok) - 2) for _ in range(200)] + [tok.eos_token_id]
    fast, slow = pieces_both_ways(tok, prompt_ids, ids, skip_special_tokens=skip)
    assert fast == slow
    if clean_up:  # the premise: clean-up changes this text, and the pieces show it
        assert " ." in tok.backend_tokenizer.decode(ids) and " ." not in "".join(fast)
    else:  # the words, after the prompt's
        assert "".join(fast) == " " + tok.decode(ids, skip_special_tokens=skip)


# ---- stop strings ----


def test_check_finds_earliest_stop_in_new_text_only():
    c = StopChecker(["STOP", "bc", "abcd"])
    assert c.check("xxSTOPyy", 8) == ("xx", "STOP")
    assert c.check("xxSTOPyy", 2) is None  # the match lies in old text: already handled back then
    assert c.check("xxSTOPyy", 3) == ("xx", "STOP")  # its last character "P" is new
    assert c.check("xxSTOP", 1) == ("xx", "STOP")  # the match only ends in the new text
    assert c.check("xabcd", 4) == ("xa", "bc")  # "bc" ends first
    assert StopChecker(["abc", "bc"]).check("xabcy", 5) == ("x", "abc")  # same end: the longer one
    assert StopChecker(["abc", "bc"], True).check("xabcy", 5) == ("xabc", "abc")
    assert StopChecker(["STOP"], include_stop_str_in_output=True).check("xxSTOPyy", 8) == ("xxSTOP", "STOP")
    assert StopChecker([]).check("anything", 8) is None
    assert StopChecker(None).holdback("anything") == 0
    assert StopChecker(["", "b"]).check("ab", 2) == ("a", "b")  # an empty stop string is ignored


def test_check_defaults_to_text_added_since_last_call():
    c = StopChecker(["end"])
    assert c.check("the e") is None
    assert c.check("the en") is None
    assert c.check("the end") == ("the ", "end")
    c = StopChecker(["end"])
    assert c.check("the end") == ("the ", "end")  # first call: all of it is new


def test_holdback():
    c = StopChecker(["world", "wax", "###"])
    assert c.holdback("Hello wor") == 3
    assert c.holdback("Hello w") == 1
    assert c.holdback("Hello wa") == 2
    assert c.holdback("Hello") == 0
    assert c.holdback("a ##") == 2
    assert c.holdback("w") == 1
    assert c.holdback("") == 0
    assert c.holdback("Hello world") == 0  # a whole stop string is check's business, not a partial one
    assert StopChecker(["world"], include_stop_str_in_output=True).holdback("Hello wor") == 0


def run_engine(tok, prompt, ids, stop, include=False):
    """The engine's loop: detokenize, check stop strings, stream only text that can no longer be cut.
    Returns (what a streaming client received, in order; final text; matched stop string)."""
    detok = IncrementalDetokenizer(tok, prompt)
    checker = StopChecker(stop, include)
    sent, received = 0, []
    for i in ids:
        piece = detok.step([i])
        hit = checker.check(detok.text, len(piece))
        if hit:
            text, matched = hit
            assert len(text) >= sent, "the client saw text that the stop string cut off"
            received.append(text[sent:])
            return received, text, matched
        visible = len(detok.text) - checker.holdback(detok.text)
        assert visible >= sent
        received.append(detok.text[sent:visible])
        sent = visible
    detok.flush()
    received.append(detok.text[sent:])
    return received, detok.text, None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize(
    "text, stop, before",
    [
        ("The answer is 42. Done here.", "answer is 4", "The "),
        ("The answer is 42. Done here.", "2. Do", "The answer is 4"),
        ("인사: 안녕하세요 세계", "하세요", "인사: 안녕"),
        ("Wave 👋🏽 now", "👋🏽 n", "Wave "),
    ],
)
def test_stop_string_spanning_tokens(tok, prompt, text, stop, before, include):
    ids = enc(tok, text)
    assert not any(stop in tok.decode([i]) for i in ids)  # really spans several tokens
    received, final, matched = run_engine(tok, prompt, ids, [stop, "never"], include)
    assert matched == stop
    assert final == (before + stop if include else before)
    assert "".join(received) == final
    assert not any(REPLACEMENT_CHAR in r for r in received)
    if not include:  # the client never saw any part of the stop string
        assert all(stop[:2] not in r for r in received)


def test_partial_stop_that_does_not_match_is_released(tok, prompt):
    text = "The answer is 42. Done here."
    received, final, matched = run_engine(tok, prompt, enc(tok, text), ["answer was", "Done there"])
    assert matched is None
    assert final == "".join(received) == text
    # "answer " was held back until "is" showed it is no stop string
    assert not any(r.endswith("answer") or r.endswith("answer ") for r in received)
