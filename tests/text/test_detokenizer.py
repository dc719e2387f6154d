"""IncrementalDetokenizer: streamed deltas join to the full decode, also when tokens split UTF-8
characters, with sentencepiece-style leading spaces, and with each step decoding a small window."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from asyncengine.text.detokenizer import IncrementalDetokenizer
from asyncengine.text.tokenizer import Tokenizer

MULTIBYTE_TEXT = "你好，世界！こんにちは 🙂🙃👍🏽🎉 naïve café ÅßØ € ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🇫🇷 ok"
NATURAL_TEXT = (
    "The quick brown fox jumps over the lazy dog. 素早い茶色の狐が怠惰な犬を飛び越える。 "
    "Numbers 1234567890 and emoji 🦊🐶 mixed in, with tabs\tand\nnew lines. "
)


@pytest.fixture(scope="module")
def partial_character_ids(tokenizer: Tokenizer) -> list[int]:
    """Tokens that decode alone to U+FFFD: pieces of multi-byte characters."""
    ids = set(tokenizer.encode(MULTIBYTE_TEXT))
    ids.update(i for i in range(17, 400) if "\ufffd" in tokenizer.decode([i]))
    return sorted(i for i in ids if "\ufffd" in tokenizer.decode([i]))


def _stream(
    tokenizer: Tokenizer,
    ids: list[int],
    chunk_sizes: list[int],
    skip_special_tokens: bool = True,
    prompt_ids: list[int] | None = None,
) -> tuple[list[str], IncrementalDetokenizer]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids)
    deltas: list[str] = []
    position, turn = 0, 0
    while position < len(ids):
        size = chunk_sizes[turn % len(chunk_sizes)] if chunk_sizes else 1
        deltas.append(detokenizer.add(ids[position : position + size]))
        position += size
        turn += 1
    deltas.append(detokenizer.flush())
    return deltas, detokenizer


def test_multibyte_text_streams_token_by_token_without_replacement_chars(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the text does split characters
    deltas, detokenizer = _stream(tokenizer, ids, [1])
    assert "".join(deltas) == MULTIBYTE_TEXT == detokenizer.text
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing was left to flush


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    skip_special_tokens=st.booleans(),
)
def test_random_token_streams_join_to_the_full_decode(
    tokenizer: Tokenizer, partial_character_ids: list[int], data, chunk_sizes, skip_special_tokens
) -> None:
    token = st.one_of(
        st.sampled_from(partial_character_ids),
        st.integers(0, tokenizer.vocab_size - 1),
        st.integers(0, 16),  # special tokens
    )
    ids = data.draw(st.lists(token, max_size=40))
    deltas, detokenizer = _stream(tokenizer, ids, chunk_sizes, skip_special_tokens)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens) == detokenizer.text


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(
        st.characters(
            max_codepoint=0x3FFFF,
            exclude_categories=("Cs",),
            exclude_characters="\x04\x06\x13\x14\x16\x1d",
        ),
        max_size=40,
    ),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_encoded_text_streams_back_unchanged(
    tokenizer: Tokenizer, text: str, chunk_sizes: list[int]
) -> None:
    deltas, _ = _stream(tokenizer, tokenizer.encode(text), chunk_sizes, skip_special_tokens=False)
    assert "".join(deltas) == text
    assert not any(delta.endswith("\ufffd") for delta in deltas)


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.sampled_from(["Hello", "你好", "User: 🙂", "a b c", "<|im_start|>assistant\n"]),
    data=st.data(),
)
def test_prompt_context_gives_what_the_output_adds(
    tokenizer: Tokenizer, partial_character_ids, prompt, data
) -> None:
    prompt_ids = tokenizer.encode(prompt)
    ids = data.draw(
        st.lists(
            st.one_of(st.sampled_from(partial_character_ids), st.integers(17, 3000)), max_size=20
        )
    )
    deltas, _ = _stream(tokenizer, ids, [1], prompt_ids=prompt_ids)
    prompt_text = tokenizer.decode(prompt_ids)
    full = tokenizer.decode(prompt_ids + ids)
    assert full.startswith(prompt_text)
    assert "".join(deltas) == full[len(prompt_text) :]


class _CountingTokenizer(Tokenizer):
    """Records the longest id list each decode call received."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.longest_decode = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_step_decodes_a_small_window(tokenizer: Tokenizer) -> None:
    counting = _CountingTokenizer(tokenizer.model_dir)
    ids = tokenizer.encode(NATURAL_TEXT * 20)
    assert len(ids) > 1000
    deltas, _ = _stream(counting, ids, [1])
    assert "".join(deltas) == NATURAL_TEXT * 20
    assert counting.longest_decode <= 8


def test_an_output_that_keeps_ending_in_a_replacement_char_decodes_a_small_window(
    tokenizer: Tokenizer, partial_character_ids: list[int]
) -> None:
    """Bytes that never complete a character (a lead byte over and over, as a request that
    allows only that token gets) are emitted as U+FFFD a few tokens on, not held in a window
    that grows with the output."""
    counting = _CountingTokenizer(tokenizer.model_dir)
    lead = next(i for i in partial_character_ids if tokenizer.decode([i, i]) == "\ufffd" * 2)
    word = tokenizer.encode("ok")
    for ids in ([lead] * 2000, [lead, *word] * 700):
        counting.longest_decode = 0
        deltas, _ = _stream(counting, ids, [1])
        assert "".join(deltas) == tokenizer.decode(ids)
        assert counting.longest_decode <= 16


@settings(max_examples=200, deadline=None)
@given(data=st.data(), chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_long_runs_of_character_pieces_join_to_the_full_decode(
    tokenizer: Tokenizer, partial_character_ids: list[int], data, chunk_sizes
) -> None:
    """Runs long enough that held pieces are taken as final on the way: the text is still the
    whole output's decode."""
    token = st.one_of(
        st.sampled_from(partial_character_ids), st.integers(0, tokenizer.vocab_size - 1)
    )
    ids = data.draw(st.lists(token, min_size=10, max_size=120))
    deltas, detokenizer = _stream(tokenizer, ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.decode(ids) == detokenizer.text


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A sentencepiece-style BPE: words carry a leading '▁' that decoding turns into a space,
    except at the start of the decoded text."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = [NATURAL_TEXT, "the cat sat on the mat", "hello world, hello there"] * 5
    backend.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"])
    )
    directory = tmp_path_factory.mktemp("metaspace")
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["the", "cat", "hello", "world,", "mat", "x", "Numbers"]), max_size=12
    ),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
)
def test_leading_spaces_of_sentencepiece_tokens_survive_streaming(
    metaspace_tokenizer: Tokenizer, words: list[str], chunk_sizes: list[int]
) -> None:
    ids = metaspace_tokenizer.encode(" ".join(words))
    deltas, _ = _stream(metaspace_tokenizer, ids, chunk_sizes)
    assert "".join(deltas) == metaspace_tokenizer.decode(ids) == " ".join(words)
