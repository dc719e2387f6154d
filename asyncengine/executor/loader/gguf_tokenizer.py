"""Rebuild a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are rebuilt here, with the
pre-tokenizer llama.cpp names in ``tokenizer.ggml.pre``: SmolLM's splits every digit on its own
(its vocabulary has no multi-digit token), which transformers' own GGUF converter leaves out.
Other vocabularies (sentencepiece, unigram) go through transformers' converter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger("asyncengine.loader")

CONTROL_TOKEN = 3  # llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user defined,
USER_DEFINED_TOKEN = 4  # 5 unused, 6 byte
UNUSED_TOKEN = 5

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names, grouped by the split they perform.
_DIGIT_SPLIT_THEN_GPT2 = {
    "smollm",
    "starcoder",
    "refact",
    "codeshell",
    "exaone",
    "minerva",
    "command-r",
}
_GPT2 = {"default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "olmo", "stablelm2"}
_REGEX_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGIT_SPLIT_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre is not None and pre not in _GPT2:
        log.warning("unknown GGUF pre-tokenizer %r: splitting text the GPT-2 way", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _special_token_processor(
    tokens: list[str], bos_id: int | None, eos_id: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor:
    specials: list[tuple[str, int]] = []
    prefix = suffix = ""
    if add_bos and bos_id is not None:
        specials.append((tokens[bos_id], bos_id))
        prefix = f"{tokens[bos_id]} "
    if add_eos and eos_id is not None:
        specials.append((tokens[eos_id], eos_id))
        suffix = f" {tokens[eos_id]}"
    if not specials:
        return processors.ByteLevel(trim_offsets=False)
    return processors.TemplateProcessing(
        single=f"{prefix}$A{suffix}",
        pair=f"{prefix}$A{suffix} {prefix}$B:1{suffix}",
        special_tokens=list(dict.fromkeys(specials)),
    )


def byte_level_bpe_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The tokenizer a gpt2-style GGUF vocabulary describes."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary holds duplicate tokens")
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _special_token_processor(
        tokens,
        metadata.get("tokenizer.ggml.bos_token_id"),
        metadata.get("tokenizer.ggml.eos_token_id"),
        bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )
    # Control tokens (<|im_start|>, ...) are matched whole in text and dropped by
    # skip_special_tokens, as are unused ones (a vocabulary padded to the embedding's rows:
    # "[PAD123]", which llama.cpp prints as nothing); user-defined ones are matched whole but
    # kept.
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind in (CONTROL_TOKEN, UNUSED_TOKEN)
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, token_types, strict=True)
            if kind == USER_DEFINED_TOKEN
        ]
    )
    return tokenizer


def converted_by_transformers(gguf_path: Path) -> Tokenizer:
    """transformers' GGUF tokenizer converter, for vocabularies other than byte-level BPE."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return hf_tokenizer.backend_tokenizer


def build_tokenizer(metadata: dict[str, Any], gguf_path: Path) -> Tokenizer:
    if metadata.get("tokenizer.ggml.model") == "gpt2":
        return byte_level_bpe_tokenizer(metadata)
    return converted_by_transformers(gguf_path)


def tokenizer_config(metadata: dict[str, Any], context_length: int | None) -> dict[str, Any]:
    """tokenizer_config.json: special token strings, BOS/EOS flags and the chat template."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "chat_template": metadata.get("tokenizer.chat_template"),
        "model_max_length": context_length,
    }
    return {key: value for key, value in config.items() if value is not None}
