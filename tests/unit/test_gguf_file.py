"""common/gguf_file.py, our GGUF reader, against gguf's own `GGUFReader`: the same metadata
values and the same tensor arrays, for the default model and for a file with every value type,
in both byte orders."""

import gguf
import numpy as np
import pytest

from pagemesh.common.gguf_file import _read, read_gguf
from pagemesh.common.model_files import default_model_path


def assert_reads_as_gguf_does(path):
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    # GGUFReader adds the header's numbers as pseudo fields "GGUF.*"; they are no metadata
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, theirs_t in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == theirs_t.tensor_type
        assert list(mine.shape) == [int(d) for d in theirs_t.shape]
        assert mine.data.dtype == theirs_t.data.dtype and mine.data.shape == theirs_t.data.shape
        assert np.array_equal(mine.data, theirs_t.data), mine.name
        assert not mine.data.flags.writeable
    return ours


def test_the_default_model_reads_as_gguf_reads_it():
    f = assert_reads_as_gguf_does(default_model_path())
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in f.tensors} >= {"Q4_1", "F32"}


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_kind(tmp_path, endian):
    path = tmp_path / f"all-{endian.name}.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 65000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁wörld")
    w.add_array("t.strings", ["", "a", "ü" * 300])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("ints", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blocks", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = assert_reads_as_gguf_does(path)
    assert f.metadata["t.u64"] == 2**63 + 5 and f.metadata["t.strings"][2] == "ü" * 300
    assert next(t for t in f.tensors if t.name == "blocks").data.shape == (4, 68)  # 2 blocks of 34 bytes a row


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path().read_bytes()[:5000])  # in the middle of the metadata
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf(cut)
    _read.cache_clear()


def _mapped_pss_kb(path) -> int:
    """This process's PSS of the mappings of `path` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                current = parts[5] if len(parts) > 5 else ""
            elif parts and parts[0] == "Pss:" and current == str(path):
                total += int(parts[1])
    return total


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_DONTNEED"), reason="no madvise here")
def test_dropped_pages_leave_the_process_and_read_back_the_same(tmp_path):
    from pagemesh.common.gguf_file import drop_resident_pages

    path = tmp_path / "copy.gguf"  # a file of its own: no other test's mapping shares its pages
    path.write_bytes(default_model_path().read_bytes())
    tensors = read_gguf(path).tensors
    sums = [int(t.data.sum(dtype=np.uint64 if t.data.dtype == np.uint8 else np.float64)) for t in tensors]
    touched = _mapped_pss_kb(path.resolve())
    assert touched > 50_000  # the whole file was read: ~93 MB
    assert drop_resident_pages()
    assert _mapped_pss_kb(path.resolve()) < touched // 20
    assert [int(t.data.sum(dtype=np.uint64 if t.data.dtype == np.uint8 else np.float64)) for t in tensors] == sums
    _read.cache_clear()
