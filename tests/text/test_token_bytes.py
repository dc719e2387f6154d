"""Tokenizer.token_bytes (OpenAI's logprob ``bytes``) and TextOffsets (the legacy
``text_offset``) on text whose characters span several tokens: the embedded byte-level BPE
tokenizer and a sentencepiece-style one with byte fallback (Llama 2's scheme)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers

from asyncengine.text.detokenizer import TextOffsets
from asyncengine.text.tokenizer import Tokenizer

TEXT = "日本語 🎉 naïve café ok"
SPACE = "\u2581"


@pytest.fixture(scope="module")
def byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Words of ASCII letters and '▁' (a space) as tokens, every other character its UTF-8
    bytes as ``<0xXX>`` tokens; decoded as Llama 2's tokenizer.json decodes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in [SPACE, *"abcdefghijklmnopqrstuvwxyz", SPACE + "o", SPACE + "ok"]:
        vocab[piece] = len(vocab)
    merges = [(SPACE, "o"), (SPACE + "o", "k")]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    directory = tmp_path_factory.mktemp("byte_fallback")
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def test_byte_level_tokens_bytes_join_to_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.token_bytes(t) for t in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert any(piece.decode("utf-8", "replace") != piece.decode("latin-1") for piece in pieces)
    special = tokenizer.encode("<|im_end|>")
    assert [tokenizer.token_bytes(t) for t in special] == [b"<|im_end|>"]
    assert tokenizer.token_bytes(tokenizer.vocab_size) == b""  # an id without a token


def test_byte_fallback_tokens_are_the_bytes_they_name(byte_fallback: Tokenizer) -> None:
    ids = byte_fallback.encode(TEXT)
    assert [byte_fallback.token_bytes(t) for t in ids[:2]] == [b" ", b"\xe6"]  # '▁', 日's first
    # every '▁' is a space, the text's first one too (the decode drops that one)
    joined = b"".join(byte_fallback.token_bytes(t) for t in ids)
    assert joined == b" " + TEXT.encode()
    assert byte_fallback.decode(ids) == TEXT
    assert byte_fallback.token_bytes(-1) == b""


@pytest.mark.parametrize("name", ["tokenizer", "byte_fallback"])
def test_text_offsets_count_the_characters_decoded_before_each_token(
    name: str, request: pytest.FixtureRequest
) -> None:
    tokenizer: Tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(TEXT)
    offsets = TextOffsets(tokenizer.detokenizer(False), start=3)
    # fed in two deltas, as a stream's are
    got = offsets.of(ids[:4], end=3 + len(TEXT)) + offsets.of(ids[4:], end=3 + len(TEXT))
    # the whole characters in the bytes of the tokens before each (less the text's leading
    # space, which a sentencepiece decode drops)
    lead = 1 if name == "byte_fallback" else 0
    before = [b"".join(tokenizer.token_bytes(t) for t in ids[:i])[lead:] for i in range(len(ids))]
    expected = [3 + len(data.decode("utf-8", "ignore")) for data in before]
    assert got == expected
    assert got == sorted(got) and got[-1] < 3 + len(TEXT)
    # none past the text returned (a stop string may cut it short)
    cut = TextOffsets(tokenizer.detokenizer(False)).of(ids, end=2)
    assert max(cut) == 2 and cut == sorted(cut)


def test_text_offsets_do_not_walk_back_over_a_split_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🎉🎉")
    assert len(ids) > 2  # the emoji is byte pieces
    got = TextOffsets(tokenizer.detokenizer(False)).of(ids, end=2)
    assert got[0] == 0 and set(got) == {0, 1}
