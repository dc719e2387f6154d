"""read_gguf_file gives what gguf.GGUFReader gives (metadata values, tensor views), from a map
of the file: on a file holding every value type, and on the embedded model's."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from asyncengine.executor.loader import DEFAULT_MODEL, KNOWN_MODELS
from asyncengine.executor.loader.gguf_file import StringArray, read_gguf_file
from asyncengine.executor.loader.hf_dir import ModelFilesError


def assert_same_as_gguf_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    got = read_gguf_file(path)
    assert got.metadata == want
    assert [t.name for t in got.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(got.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(n) for n in theirs.shape)
        assert (ours.n_elements, ours.n_bytes) == (int(theirs.n_elements), int(theirs.n_bytes))
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, np.asarray(theirs.data), equal_nan=True)


def test_every_value_type_and_tensor_kind(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(
        rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("vector", rng.standard_normal(7).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)
    got = read_gguf_file(path)
    assert got.metadata["t.str"] == "héllo ✓" and got.metadata["t.strs"] == ["a", "", "ü"]
    assert got.tensor("q8_0") is not None and got.tensor("missing") is None


def test_the_embedded_model_file() -> None:
    assert_same_as_gguf_reader(KNOWN_MODELS[DEFAULT_MODEL].gguf_path())


def test_not_a_gguf_file_and_a_truncated_one_are_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelFilesError, match="not a GGUF file"):
        read_gguf_file(tmp_path / "x.gguf")
    whole = KNOWN_MODELS[DEFAULT_MODEL].gguf_path().read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelFilesError, match="past the end"):
        read_gguf_file(tmp_path / "cut.gguf")


def test_a_vocabulary_is_decoded_when_first_read() -> None:
    path = Path(KNOWN_MODELS[DEFAULT_MODEL].gguf_path())
    tokens = read_gguf_file(path).metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray)
    assert len(tokens) == 49152 and tokens._strings is None  # its length alone decodes nothing
    want = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()
    assert tokens[0] == want[0] and tokens[-1] == want[-1] and list(tokens) == want
    assert tokens == want and tokens[10:12] == want[10:12]
