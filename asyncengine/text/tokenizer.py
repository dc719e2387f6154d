"""Tokenizer: encode, decode and the chat template (the detokenizer is in detokenizer.py).

The tokenizer is the `tokenizers` library's fast tokenizer read straight from tokenizer.json
(transformers converts a directory that has none); chat templates are rendered with jinja2 the
way transformers renders them. Decoding is called once or twice per generated token, so it goes
to the Rust tokenizer without the transformers wrapper.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

from asyncengine.common.sampling_params import InvalidRequestError
from asyncengine.executor.loader.hf_dir import ModelFilesError, load_eos_token_ids, read_json
from asyncengine.text.detokenizer import (
    ByteLevelDetokenizer,
    IncrementalDetokenizer,
    TokenBytes,
    piece_bytes,
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SLOW_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "spiece.model")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves the template
_GIL_FREE_CHARS = 1024  # texts this long are encoded without the GIL (as fast from here on)


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template, the messages are malformed, or the template refused them."""


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_backend(model_dir: Path) -> BackendTokenizer:
    path = model_dir / TOKENIZER_FILE
    if path.is_file():
        return BackendTokenizer.from_file(str(path))
    if not any((model_dir / name).is_file() for name in SLOW_TOKENIZER_FILES):
        raise ModelFilesError(
            f"{model_dir} holds no tokenizer ({TOKENIZER_FILE} or {SLOW_TOKENIZER_FILES[0]})"
        )
    from transformers import AutoTokenizer  # converts sentencepiece / vocab.json directories

    try:
        converted = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as error:
        raise ModelFilesError(f"{model_dir}: cannot build a tokenizer: {error}") from error
    backend = getattr(converted, "backend_tokenizer", None)
    if backend is None:
        raise ModelFilesError(
            f"{model_dir}: no {TOKENIZER_FILE} and no fast tokenizer could be built"
        )
    return backend


def _load_chat_template(model_dir: Path, config: dict[str, Any]) -> tuple[str | None, Path]:
    """The model's chat template (None: it has none) and the file it comes from."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8"), path
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return (template if isinstance(template, str) else None), model_dir / TOKENIZER_CONFIG_FILE


def compile_chat_template(template: str | None, source: str | Path) -> Template | None:
    """``template`` compiled at load, so that a broken one stops the start-up, not a chat
    request; ModelFilesError naming ``source`` (its file) and jinja2's error if it does not
    compile."""
    if template is None:
        return None
    try:
        return _chat_environment().from_string(template)
    except TemplateSyntaxError as error:
        raise ModelFilesError(
            f"{source}: the chat template does not compile: line {error.lineno}: {error.message}"
        ) from error


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlocks(Extension):
    """transformers' ``{% generation %} ... {% endgeneration %}`` (it marks the assistant's
    tokens for training masks): its body, rendered as is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # Same settings transformers renders chat templates with, so a model's template renders
    # the same text here as in transformers.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationBlocks],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """A model directory's tokenizer.

    ``eos_token_ids``: generation_config.json's, config.json's and the tokenizer's EOS token.
    ``vocab_size``: tokens the tokenizer knows, added tokens included (the model's embedding
    table may be larger).
    """

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        self.backend = _load_backend(model_dir)
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = read_json(config_path) if config_path.is_file() else {}
        self.chat_template, template_source = _load_chat_template(model_dir, config)
        self._compiled_template = compile_chat_template(self.chat_template, template_source)
        self.special_tokens: dict[str, str] = {
            name: content
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (content := _token_content(config.get(name))) is not None
        }
        self.bos_token_id = self._special_id("bos_token")
        self.pad_token_id = self._special_id("pad_token")
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: list[int] = sorted(
            index
            for index, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        )
        eos_ids = load_eos_token_ids(model_dir)
        if (eos := self._special_id("eos_token")) is not None and eos not in eos_ids:
            eos_ids.append(eos)
        self.eos_token_ids: list[int] = eos_ids
        # byte-level BPE: each token's bytes, by skip_special_tokens (made at first use)
        self._byte_level = isinstance(self.backend.decoder, decoders.ByteLevel)
        self._token_bytes: dict[bool, TokenBytes] = {}
        self._piece_bytes: dict[int, bytes] = {}  # token_bytes of the other tokenizers, by id

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) < _GIL_FREE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # `encode` holds the GIL for the whole text (seconds for a 4 MiB body), `encode_batch`
        # lets it go: a long prompt tokenized on a worker thread leaves the event loop free
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, skip_special_tokens: bool = True, prompt_ids: list[int] | None = None
    ) -> IncrementalDetokenizer | ByteLevelDetokenizer:
        """A fresh incremental detokenizer for one request's output: a table lookup per token
        for byte-level BPE tokenizers, windows decoded by the tokenizer for the others."""
        if not self._byte_level:
            return IncrementalDetokenizer(self, skip_special_tokens, prompt_ids)
        return ByteLevelDetokenizer(self._byte_table(skip_special_tokens), prompt_ids)

    def _byte_table(self, skip_special_tokens: bool) -> TokenBytes:
        table = self._token_bytes.get(skip_special_tokens)
        if table is None:
            added = self.backend.get_added_tokens_decoder()
            skipped = frozenset(i for i, t in added.items() if t.special and skip_special_tokens)
            # id_to_token: an added token's content where one has the id, else the model's
            table = TokenBytes(self.backend.id_to_token, self.vocab_size, skipped)
            self._token_bytes[skip_special_tokens] = table
        return table

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (OpenAI's logprob ``bytes``): those of a piece of a
        multi-byte character are that piece, so a sequence's joined are its decoded UTF-8. A
        special token gives its text, an id without a token b"". Worked out once per id."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        if self._byte_level:
            return self._byte_table(False)[token_id]
        known = self._piece_bytes.get(token_id)
        if known is None:
            token = self.backend.id_to_token(token_id)
            known = self._piece_bytes[token_id] = b"" if token is None else piece_bytes(token)
        return known

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> str:
        """The prompt text for a conversation (encode it with add_special_tokens=False)."""
        if self._compiled_template is None:
            raise ChatTemplateError(
                f"the model in {self.model_dir} has no chat template: send a plain prompt "
                "(a string or token ids) instead of chat messages"
            )
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError(
                "messages must be a non-empty list of {'role', 'content'} objects"
            )
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"messages[{index}] must be an object with a string 'role'")
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **variables,
            )
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template rejected the messages: {error}") from error
        except Exception as error:
            # the template's own code on the caller's values (a division by a
            # chat_template_kwargs value, an index past a list): the request's fault
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(error).__name__}: {error}"
            ) from error


def prompt_token_ids(
    tok: Any, prompt: object, vocab_size: int, add_special_tokens: bool
) -> list[int]:
    """The token ids an engine queues for ``prompt``: text, token ids, or chat messages (through
    the chat template of ``tok``); ``InvalidRequestError`` for a prompt it would refuse.
    ``add_special_tokens`` (vLLM's): a text gets those its tokenizer adds (a BOS, say); chat
    messages never do, their template writes its own."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        ids = tok.encode(prompt, add_special_tokens=add_special_tokens)
        return in_vocabulary(list(ids), vocab_size, encoded=True)
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "prompt must be a non-empty string, list of token ids, or list of chat messages"
        )
    ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
    if len(ids) == len(prompt):
        return in_vocabulary(ids, vocab_size, encoded=False)
    messages = [m for m in prompt if isinstance(m, dict)]
    if len(messages) == len(prompt):
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(
                    f"message {i} needs a string 'role' and a string 'content'"
                )
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        return in_vocabulary(list(tok.encode(text)), vocab_size, encoded=True)
    raise InvalidRequestError(
        "prompt list must hold only token ids (int) or only chat messages (dict)"
    )


def in_vocabulary(ids: list[int], vocab: int, encoded: bool, param: str | None = None) -> list[int]:
    """``ids``, or InvalidRequestError (naming ``param``) for the first outside the model's
    embedding rows: the forward would fail on it, and with it every request in its batch.
    ``encoded``: the tokenizer made them (it knows more tokens than the model has rows)."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return ids
    bad = next(t for t in ids if not 0 <= t < vocab)
    if encoded:
        raise InvalidRequestError(
            f"the prompt encodes to token id {bad}, outside the model's vocabulary [0, {vocab}): "
            "the tokenizer knows more tokens than the model has embeddings",
            param,
        )
    raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab})", param)
