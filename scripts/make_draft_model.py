#!/usr/bin/env python
"""A draft model for speculative decoding from the embedded SmolLM2-135M: its first N layers.

Writes a GGUF file with the model's metadata (the block count set to N), its tokenizer, its
embedding, final norm and LM head, and its first N transformer blocks, every tensor as stored
(Q4_1 / Q8_0 blocks: the draft runs on the same quantized CPU kernels as the target). Same
tokenizer as the target by construction; an early exit of the target, so it agrees with it on
the easy tokens. Written to the model cache (``$ASYNCENGINE_CACHE``, default
``~/.cache/asyncengine``) unless ``--out`` says otherwise; prints its path.

    python scripts/make_draft_model.py --layers 6
    asyncengine serve --speculative '{"method": "draft", "model": "<printed path>"}'
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf

from asyncengine.common.private_cache import cache_dir
from asyncengine.executor.loader.default_model import DEFAULT_MODEL, KNOWN_MODELS
from asyncengine.script_main import run_main

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def write_first_layers(source: Path, out: Path, layers: int) -> int:
    """Copy ``source`` (a GGUF) to ``out`` keeping its first ``layers`` blocks; returns the
    source's block count."""
    reader = gguf.GGUFReader(source)
    arch_field = reader.fields[gguf.Keys.General.ARCHITECTURE]
    arch = str(arch_field.contents())
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"--layers must be 1..{total}, got {layers}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_suffix(".partial")
    writer = gguf.GGUFWriter(staging, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    kept = [
        t
        for t in reader.tensors
        if (match := _BLOCK.match(t.name)) is None or int(match.group(1)) < layers
    ]
    for tensor in kept:
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    staging.rename(out)
    return total


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks to keep")
    parser.add_argument("--out", type=Path, default=None, help="the .gguf file to write")
    args = parser.parse_args(argv)
    source = KNOWN_MODELS[DEFAULT_MODEL].gguf_path()
    out = args.out or cache_dir() / f"{DEFAULT_MODEL}-first{args.layers}-draft.gguf"
    if out.suffix != ".gguf":
        raise ValueError(f"--out must end in .gguf (the loader reads it by its suffix): {out}")
    total = write_first_layers(source, out, args.layers)
    print(f"wrote {out} ({args.layers} of {total} layers of {source.name})")
    return out


if __name__ == "__main__":
    run_main(main)
