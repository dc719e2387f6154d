"""ByteLevelDetokenizer (a table lookup per token) against the tokenizer's own decode and the
window-decoding IncrementalDetokenizer, on the embedded SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.text.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer
from asyncengine.text.tokenizer import Tokenizer

TEXT = "你好，世界！🙂👍🏽 naïve café € 𝔘𝔫𝔦 🇫🇷 The quick brown fox.\n\tok <|im_start|>"


def _streamed(tokenizer: Tokenizer, ids: list[int], skip: bool, prompt: list[int] | None) -> str:
    detokenizer = tokenizer.detokenizer(skip, prompt)
    assert isinstance(detokenizer, ByteLevelDetokenizer)
    text = "".join(detokenizer.add([i]) for i in ids) + detokenizer.flush()
    assert detokenizer.text == text
    return text


def test_the_byte_level_path_is_chosen_for_a_byte_level_tokenizer(tokenizer: Tokenizer) -> None:
    assert isinstance(tokenizer.detokenizer(), ByteLevelDetokenizer)


def test_multibyte_text_streams_whole_characters(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detokenizer = tokenizer.detokenizer()
    deltas = [detokenizer.add([i]) for i in ids]
    assert "".join(deltas) + detokenizer.flush() == tokenizer.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


# ids: mostly any token, often the first 300 (single bytes, special tokens), whose pieces of
# multi-byte characters make incomplete and invalid UTF-8
_ids = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 49151)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ids=_ids, skip=st.booleans())
def test_joined_deltas_equal_the_tokenizers_decode(
    tokenizer: Tokenizer, ids: list[int], skip: bool
) -> None:
    assert _streamed(tokenizer, ids, skip, None) == tokenizer.decode(ids, skip)


@settings(max_examples=300, deadline=None)
@given(ids=_ids, prompt=st.lists(st.integers(0, 49151), max_size=8), skip=st.booleans())
def test_with_a_prompt_it_adds_what_the_window_decoder_adds(
    tokenizer: Tokenizer, ids: list[int], prompt: list[int], skip: bool
) -> None:
    # One case is left out: a prompt whose decoded end is U+FFFD (its last bytes an incomplete
    # character) that the output's bytes make invalid. The window decoder then hands that
    # U+FFFD out with the output; here it stays with the prompt, whose text it belongs to.
    context = prompt[-IncrementalDetokenizer.PROMPT_CONTEXT_TOKENS :]
    if tokenizer.decode(context, skip).endswith("\ufffd"):
        return
    window = IncrementalDetokenizer(tokenizer, skip, prompt)
    expected = "".join(window.add([i]) for i in ids) + window.flush()
    assert _streamed(tokenizer, ids, skip, prompt) == expected


def test_several_tokens_at_once_and_unknown_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    detokenizer = tokenizer.detokenizer()
    text = detokenizer.add(ids[:5]) + detokenizer.add([10**7]) + detokenizer.add(ids[5:])
    assert text + detokenizer.flush() == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_each_ids_bytes_decode_as_the_tokenizer_decodes_it(
    tokenizer: Tokenizer, skip: bool
) -> None:
    # the table's bytes are worked out per id when first looked up: every id of the vocabulary,
    # the added tokens and an id past it
    detokenizer = tokenizer.detokenizer(skip)
    assert isinstance(detokenizer, ByteLevelDetokenizer)
    table = detokenizer._table
    assert len(table) == tokenizer.vocab_size
    for token_id in range(len(table)):
        text = table[token_id].decode("utf-8", "replace")
        assert text == tokenizer.decode([token_id], skip), token_id
    assert table[-1] == table[len(table) - 1]
    assert table[3:6] == [table[3], table[4], table[5]]
    with pytest.raises(IndexError):
        table[len(table)]
