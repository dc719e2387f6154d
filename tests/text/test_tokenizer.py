"""Tokenizer on the embedded default model's vocabulary: round trips, agreement with transformers,
special tokens, eos ids and the ChatML chat template."""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncengine.executor.loader import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    ModelFilesError,
    write_tokenizer_dir,
)
from asyncengine.text.tokenizer import ChatTemplateError, Tokenizer

SAMPLES = [
    "Hello world!",
    " 12345 abc 3.14159, x=1000000",
    "你好，世界 🙂🙃 naïve café 😀👍🏽",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  multiple   spaces\n\n\ttabs\r\n",
    "def f(x):\n    return x ** 2  # comment",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    write_tokenizer_dir(KNOWN_MODELS[DEFAULT_MODEL].gguf_path(), directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def test_special_tokens_eos_and_vocabulary(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.all_special_ids == list(range(17))  # <|endoftext|> ... <empty_output>
    assert tokenizer.eos_token_ids == [2]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize("text", SAMPLES)
def test_encoding_matches_transformers_on_the_same_files_and_on_the_gguf(
    tokenizer: Tokenizer, tokenizer_dir: Path, hf_from_gguf, text: str
) -> None:
    hf_same_files = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tokenizer.encode(text)
    assert ids == hf_same_files.encode(text, add_special_tokens=False)
    assert ids == hf_from_gguf.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.fixture(scope="module")
def hf_from_gguf():
    path = KNOWN_MODELS[DEFAULT_MODEL].gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_digits_are_split_one_by_one(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("2024")
    assert [tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_special_tokens_are_matched_whole_and_skipped_on_request(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "assistant\nHi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # no BOS added


def test_a_long_text_is_encoded_without_holding_the_gil(tokenizer: Tokenizer) -> None:
    """The server tokenizes a long prompt on a worker thread (server/off_loop.py) to keep the
    event loop serving; that helps only if the encode lets the GIL go. With a switch interval
    too long for the interpreter to preempt the worker, this thread runs while the encode is
    still going only if the encode released the GIL itself."""
    text = "a long prompt, <|im_end|> and all " * 20_000
    started, done = threading.Event(), threading.Event()
    ids: list[int] = []

    def encode() -> None:
        started.set()
        ids.extend(tokenizer.encode(text))
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        worker = threading.Thread(target=encode)
        worker.start()
        started.wait()
        ran_during_encode = not done.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert ran_during_encode
    assert ids == tokenizer.backend.encode(text, add_special_tokens=False).ids


# SmolLM2's byte alphabet lacks 21 bytes (some C0 controls, 0xC0/0xC1 and the UTF-8 leads
# 0xF1-0xFF, so code points from U+40000 up): text made of the others round-trips.
REPRESENTABLE = st.characters(
    max_codepoint=0x3FFFF, exclude_categories=("Cs",), exclude_characters="\x04\x06\x13\x14\x16\x1d"
)


@settings(max_examples=150, deadline=None)
@given(st.text(REPRESENTABLE, max_size=60))
def test_any_text_round_trips(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_is_chatml_with_the_default_system_prompt(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=False
    )
    assert prompt == without_prompt + "<|im_start|>assistant\n"


def test_chat_template_renders_like_transformers(tokenizer: Tokenizer, tokenizer_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for add_generation_prompt in (True, False):
        ours = tokenizer.apply_chat_template(
            CONVERSATION, add_generation_prompt=add_generation_prompt
        )
        theirs = hf.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    assert ours.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_model_without_template_gives_a_clear_error(tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    plain = Tokenizer(tmp_path)
    assert plain.chat_template is None
    assert plain.encode("Hello") == Tokenizer(tokenizer_dir).encode("Hello")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_file_and_template_errors(tokenizer_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
    )
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[user] "é"\n'
    with pytest.raises(ChatTemplateError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        tok.apply_chat_template([])


def test_a_template_that_does_not_compile_stops_the_load_naming_its_file(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = tmp_path / "chat_template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfo %}")
    with pytest.raises(ModelFilesError) as raised:
        Tokenizer(tmp_path)
    assert str(raised.value).startswith(f"{template}: the chat template does not compile: line 2")
    assert "endfo" in str(raised.value)
    template.unlink()
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{{ messages[0].content "}))
    with pytest.raises(ModelFilesError, match=re.escape(f"{config}: the chat template does not")):
        Tokenizer(tmp_path)


def test_directory_without_tokenizer_files_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesError, match="no tokenizer"):
        Tokenizer(tmp_path)


def test_a_template_marking_its_generation_renders_as_transformers_renders_it(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """transformers' ``{% generation %}`` blocks (assistant masks for training) load and
    render as their body, so a model whose template has them is served."""
    from transformers import PreTrainedTokenizerFast

    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ours = Tokenizer(tmp_path).apply_chat_template(messages, add_generation_prompt=False)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    hf.chat_template = (tmp_path / "chat_template.jinja").read_text()
    assert ours == hf.apply_chat_template(messages, tokenize=False) == "<user>hi<assistant>hello"
