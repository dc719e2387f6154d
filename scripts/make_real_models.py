#!/usr/bin/env python
"""Random-weight models of real shapes, converted and quantized by llama.cpp's own tools.

Speed and memory depend on a model's shape and format, not on its weights' values, so these
are the benchmark models for every speed claim (no hub needed). For each named shape:

1. a ``transformers`` config of that shape -> ``from_config`` with a fixed seed (HF's own init:
   normal(0, initializer_range) projections and embedding, unit norms) -> ``save_pretrained``
   in bfloat16, with a tokenizer (below);
2. the llama.cpp sdist's ``convert_hf_to_gguf.py`` -> a bf16 GGUF;
3. its ``llama-quantize`` -> Q4_K_M / Q5_K_M / Q6_K / Q8_0 GGUFs (Q4_0 when named).

Tokenizer: the embedded model's (SmolLM2's 49,152-token byte-level BPE with its ChatML
template), read from the asyncengine cache. The config keeps the real vocab size (128,256 /
151,936), so the embedding and LM head have their real size; the converter pads the token list
to it with ``[PADn]`` tokens, which no text encodes to. It works offline and the converter
recognizes its pre-tokenizer; a tokenizer grown to the real vocab would change no byte read per
token, only which text the random weights emit.

Everything lands in ``$ASYNCENGINE_CACHE/models/<shape>/`` (default ``~/.cache/asyncengine``):
``hf/``, ``<shape>-bf16.gguf``, ``<shape>-<FORMAT>.gguf``. Idempotent: a file already there is
kept; each is written under a temporary name and renamed. Prints one path per line.

    .venv/bin/python scripts/make_real_models.py                # 1B, 3B, 1.5B shapes, all formats
    .venv/bin/python scripts/make_real_models.py --models llama-3.2-1b --formats Q4_K_M
    .venv/bin/python scripts/make_real_models.py --models qwen3-1.7b --formats Q4_K_M
    .venv/bin/python scripts/make_real_models.py --models qwen2.5-0.5b --formats Q4_K_M Q8_0 Q4_0
    .venv/bin/python scripts/make_real_models.py --models gemma-2-2b --formats Q4_K_M
    .venv/bin/python scripts/make_real_models.py --list

Needs scripts/setup_llamacpp.sh (llama-quantize, and the converter unpacked under the peer's
venv); the HF directory alone (``--formats hf``) needs neither.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: the peers package

from peers.llamacpp import launcher as peer_llamacpp

from asyncengine.common.private_cache import cache_dir
from asyncengine.script_main import run_main

FORMATS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# made only when named: the legacy 4-bit format many small models ship in
EXTRA_FORMATS = ("Q4_0",)
HF_FORMAT = "hf"  # the bfloat16 HF directory itself
SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's shape in Hugging Face config terms (what a config.json of it says)."""

    architecture: str  # "llama", "qwen2", "qwen3", "gemma2" or "gemma3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    head_dim: int | None = None
    llama3_rope: bool = False  # Llama 3.1+ RoPE scaling (rope_type "llama3", factor 32)

    def config_dict(self) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.llama3_rope:
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        d: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "hidden_act": "silu",
        }
        if self.head_dim is not None:
            d["head_dim"] = self.head_dim
        if self.architecture == "gemma3":  # Gemma3TextConfig's own RoPE pair (local, global)
            del d["rope_parameters"], d["hidden_act"]
            d.update(sliding_window=512, query_pre_attn_scalar=self.head_dim)
        if self.architecture == "gemma2":  # every other layer sliding, Gemma2Config's default
            del d["hidden_act"]
            d.update(
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=4096,
                query_pre_attn_scalar=self.head_dim,
                attn_logit_softcapping=50.0,
                final_logit_softcapping=30.0,
            )
        if self.architecture == "llama":
            d["attention_bias"] = False
            d["mlp_bias"] = False
        return d

    @property
    def parameters(self) -> int:
        """Parameter count (embedding once when tied)."""
        h, kv_heads = self.hidden_size, self.num_kv_heads
        head_dim = self.head_dim or h // self.num_heads
        q, kv = self.num_heads * head_dim, kv_heads * head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        if self.architecture == "qwen2":
            per_layer += q + 2 * kv  # q/k/v biases
        if self.architecture in ("qwen3", "gemma3"):
            per_layer += 2 * head_dim  # the per-head q/k norms
        if self.architecture in ("gemma2", "gemma3"):
            per_layer += 2 * h  # the sandwich norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h


LLAMA3_RoPE = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "llama3_rope": True}
SHAPES: dict[str, Shape] = {
    "llama-3.2-1b": Shape(
        "llama", 2048, 16, 32, 8, 8192, 128256, True, rms_norm_eps=1e-5, head_dim=64, **LLAMA3_RoPE
    ),
    "llama-3.2-3b": Shape(
        "llama", 3072, 28, 24, 8, 8192, 128256, True, rms_norm_eps=1e-5, head_dim=128, **LLAMA3_RoPE
    ),
    "qwen2.5-1.5b": Shape(
        "qwen2", 1536, 28, 12, 2, 8960, 151936, True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    # hidden 896 and MLP 4864 are no multiples of 256, so llama-quantize falls back from the K
    # formats to Q5_0 / Q8_0 blocks there; 14 query heads over 2 kv heads (GQA 7:1)
    "qwen2.5-0.5b": Shape(
        "qwen2", 896, 24, 14, 2, 4864, 151936, True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
    # per-head q/k norms (the converter's architecture qwen3), 16 query heads over 8 kv heads
    "qwen3-1.7b": Shape(
        "qwen3", 2048, 28, 16, 8, 6144, 151936, True, rope_theta=1000000.0,
        max_position_embeddings=40960, rms_norm_eps=1e-6, head_dim=128,
    ),
    # Gemma 3 1B's layers (sliding windows of 512 on five layers in six, GELU, sandwich and q/k
    # norms); its vocabulary is the tokenizer's 49,152, not 262,144: llama.cpp's converter cuts
    # the embedding to the tokenizer's size
    "gemma-3-1b": Shape(
        "gemma3", 1152, 26, 4, 1, 6912, 49152, True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, head_dim=256,
    ),
    # Gemma 2 2B's layers (a window of 4,096 on every other layer, attention and final-logit
    # soft-caps of 50 and 30, GELU, sandwich norms) and its 256,000-token vocabulary, padded
    # (Gemma 2's converter cuts no embedding); converted with the embedded byte-level BPE
    # tokenizer as Gemma 3's converter reads one (GEMMA2_GPT2_VOCAB)
    "gemma-2-2b": Shape(
        "gemma2", 2304, 26, 8, 4, 9216, 256000, True, rope_theta=10000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-6, head_dim=256,
    ),
    # hidden 4096, MLP 14336, an untied 128k head: 16 GB of bf16 on the way (not made by default)
    "llama-3.1-8b": Shape(
        "llama", 4096, 32, 32, 8, 14336, 128256, False, rms_norm_eps=1e-5, head_dim=128,
        **LLAMA3_RoPE,
    ),
    # a few MB: the benchmark's own tests (and a quick look at the pipeline)
    "tiny-llama": Shape("llama", 256, 2, 4, 1, 512, 49152, False, rms_norm_eps=1e-5, **LLAMA3_RoPE),
    "tiny-qwen2": Shape(
        "qwen2", 256, 2, 8, 2, 512, 49152, True, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
}  # fmt: skip


def models_root() -> Path:
    return cache_dir("models")


def model_folder(name: str) -> Path:
    return models_root() / name


def gguf_path(name: str, fmt: str) -> Path:
    return model_folder(name) / f"{name}-{fmt}.gguf"


def hf_path(name: str) -> Path:
    return model_folder(name) / "hf"


def model_path(name: str, fmt: str) -> Path:
    """Where ``make`` leaves the model in ``fmt`` (``hf``: the directory)."""
    return hf_path(name) if fmt == HF_FORMAT else gguf_path(name, fmt)


def embedded_tokenizer() -> Path:
    """The embedded model's tokenizer files (written from its GGUF metadata, once, offline)."""
    from asyncengine.executor.loader import tokenizer_dir
    from asyncengine.executor.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS

    return tokenizer_dir(KNOWN_MODELS[DEFAULT_MODEL].gguf_path())


def make_hf_dir(name: str, shape: Shape, out: Path, seed: int = SEED) -> Path:
    """``out``: config.json, bf16 safetensors of HF's random init under ``seed``, the tokenizer."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers

    tokenizer = embedded_tokenizer()
    generation = _read_json(tokenizer / "generation_config.json")
    config_class = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
    }.get(shape.architecture, transformers.LlamaConfig)
    config = config_class(
        **shape.config_dict(),
        bos_token_id=generation.get("bos_token_id"),
        eos_token_id=generation.get("eos_token_id"),
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    del model
    for file in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copyfile(tokenizer / file, staging / file)
    staging.rename(out)
    print(
        f"{name}: {shape.parameters / 1e9:.2f}B parameters, HF dir in "
        f"{time.perf_counter() - started:.0f} s",
        file=sys.stderr,
    )
    return out


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def converter_script() -> Path:
    """convert_hf_to_gguf.py as scripts/setup_llamacpp.sh unpacks it under the peer's venv."""
    script = peer_llamacpp.llamacpp_venv() / "src" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise peer_llamacpp.LlamaCppUnavailableError(
            f"{script} is missing: run scripts/setup_llamacpp.sh (it unpacks the converter)"
        )
    return script


def converter_python() -> str:
    """The peer's venv python where it has the converter's requirements, else this one (whose
    torch and transformers serve the converter as well)."""
    peer = peer_llamacpp.llamacpp_venv() / "bin" / "python"
    if peer.is_file():
        probe = subprocess.run(
            [str(peer), "-c", "import torch, transformers"], capture_output=True, check=False
        )
        if probe.returncode == 0:
            return str(peer)
    return sys.executable


def quantize_binary() -> Path:
    return peer_llamacpp.server_binary().with_name("llama-quantize")


def _run_logged(command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "wb") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{command[0]} failed ({done.returncode}); {log}:\n" + "\n".join(tail))


def converter_view(hf_dir: Path) -> Path:
    """``hf_dir`` as the converter reads it: links to its files, config.json without model_type.

    The converter reads the tokenizer with ``AutoTokenizer``, which for model_type qwen2 builds
    Qwen2's own tokenizer class around tokenizer.json (its pre-tokenizer, not the file's, so
    the converter does not recognize it); without model_type it takes tokenizer.json as it is.
    The converter itself picks its model class by ``architectures``."""
    view = hf_dir.with_name(hf_dir.name + "-for-converter")
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir()
    for file in hf_dir.iterdir():
        if file.name != "config.json":
            (view / file.name).symlink_to(file.resolve())
    config = _read_json(hf_dir / "config.json")
    config.pop("model_type", None)
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return view


# Gemma 2's converter reads a SentencePiece tokenizer.model only; the embedded tokenizer is
# byte-level BPE, which it then takes as Gemma 3's converter does (its _set_vocab_gpt2). Run as
# `python -c GEMMA2_GPT2_VOCAB convert_hf_to_gguf.py ARGS...`.
GEMMA2_GPT2_VOCAB = """
import runpy, sys
from conversion import gemma
gemma.Gemma2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_bf16(name: str, hf_dir: Path, out: Path) -> Path:
    if out.is_file():
        return out
    script = converter_script()
    view = converter_view(hf_dir)
    paths = [str(script.parent), str(script.parent / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    staging = out.with_name(out.name + ".partial")
    command = [converter_python(), str(script), str(view), "--outtype", "bf16"]
    if SHAPES[name].architecture == "gemma2":
        command[1:1] = ["-c", GEMMA2_GPT2_VOCAB]
    command += ["--model-name", name, "--outfile", str(staging)]
    _run_logged(command, out.with_suffix(".convert.log"), env)
    shutil.rmtree(view)
    staging.rename(out)
    return out


def quantize(source: Path, fmt: str, out: Path, threads: int) -> Path:
    if out.is_file():
        return out
    staging = out.with_name(out.name + ".partial")
    command = [str(quantize_binary()), str(source), str(staging), fmt, str(threads)]
    _run_logged(command, out.with_suffix(".quantize.log"))
    staging.rename(out)
    return out


def make(name: str, formats: Sequence[str], threads: int | None = None) -> dict[str, Path]:
    """The model ``name`` in each of ``formats`` (``hf`` and/or GGUF types), made where missing."""
    shape = SHAPES[name]
    folder = model_folder(name)
    folder.mkdir(parents=True, exist_ok=True)
    made: dict[str, Path] = {}
    hf_dir = make_hf_dir(name, shape, hf_path(name))
    if HF_FORMAT in formats:
        made[HF_FORMAT] = hf_dir
    quantized = [fmt for fmt in formats if fmt != HF_FORMAT]
    if not quantized:
        return made
    bf16 = convert_bf16(name, hf_dir, gguf_path(name, "bf16"))
    for fmt in quantized:
        made[fmt] = (
            bf16
            if fmt == "bf16"
            else quantize(bf16, fmt, gguf_path(name, fmt), threads or os.cpu_count() or 1)
        )
    return made


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Path]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["llama-3.2-1b", "llama-3.2-3b", "qwen2.5-1.5b"],
        choices=sorted(SHAPES),
    )  # fmt: skip
    parser.add_argument(
        "--formats",
        nargs="+",
        default=list(FORMATS),
        choices=[HF_FORMAT, "bf16", *FORMATS, *EXTRA_FORMATS],
    )
    parser.add_argument("--threads", type=int, default=None, help="llama-quantize's threads")
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name}: {shape.parameters / 1e9:.2f}B parameters, {shape}")
        return {}
    made = {name: make(name, args.formats, args.threads) for name in args.models}
    for paths in made.values():
        for path in paths.values():
            print(path)
    return made


if __name__ == "__main__":
    run_main(main)
