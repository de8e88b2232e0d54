"""The store of packed weights (kernels/store.py): a second load reads what the first one made,
bit for bit, without packing, rounding or parsing the GGUF again; a damaged entry is made again
with one line; a cache it cannot write to costs one line and nothing else."""

import numpy as np
import pytest

from specdecode.kernels import store
from specdecode.models import load


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDECODE_WEIGHT_CACHE", "1")
    monkeypatch.setattr(store, "MIN_BYTES", 0)  # the tiny model's matrices are kept too
    monkeypatch.setattr(store, "CHUNK", 4096)  # and hashed in pieces
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random Qwen2 GGUF with the real pair's tensor types (Q4_K, Q6_K, Q5_0, Q8_0)."""
    from helpers import write_tiny_qwen_gguf

    return write_tiny_qwen_gguf(tmp_path_factory.mktemp("store-gguf"))[1]


def _tiles(model) -> list[np.ndarray]:
    out = []
    for _, lin in model.linears():
        for part in getattr(lin, "parts", [lin]):
            out.append(part.packed.tiles.numpy().copy())
    return out


def _never(*_a, **_k):
    raise AssertionError("made again, not read from the store")


def test_a_second_load_reads_the_packed_and_rounded_weights_without_making_them(
    cache, tiny_gguf, monkeypatch
):
    first = {fmt: _tiles(load(str(tiny_gguf), quant=fmt)) for fmt in ("kq", "kq4")}
    entries = list((cache / "weights").glob("*/*.bin"))
    assert entries and len(list((cache / "weights").glob("*/*.json"))) == len(entries)
    import gguf

    from specdecode.kernels import blocks
    from specdecode.models import gguf_quant

    monkeypatch.setattr(blocks.BlockWeight, "tiles", _never)  # the packing
    monkeypatch.setattr(blocks.np, "concatenate", _never)  # stacking q|k|v and gate|up
    monkeypatch.setattr(gguf_quant, "quantize_q4_0", _never)  # kq4's rounding
    monkeypatch.setattr(gguf.quants, "dequantize", _never)
    monkeypatch.setattr(gguf, "GGUFReader", _never)  # the file's index
    for fmt, want in first.items():
        got = _tiles(load(str(tiny_gguf), quant=fmt))
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want)), fmt


def test_the_store_off_makes_every_time_and_keeps_nothing(cache, tiny_gguf, monkeypatch):
    monkeypatch.setenv("SPECDECODE_WEIGHT_CACHE", "0")
    on_the_fly = _tiles(load(str(tiny_gguf), quant="kq4"))
    assert not (cache / "weights").exists()
    monkeypatch.setenv("SPECDECODE_WEIGHT_CACHE", "1")
    stored = _tiles(load(str(tiny_gguf), quant="kq4"))
    assert all(np.array_equal(a, b) for a, b in zip(stored, on_the_fly))


def test_a_damaged_entry_is_made_again_with_one_line(cache, tiny_gguf, capsys):
    want = _tiles(load(str(tiny_gguf), quant="kq"))
    entry = max((cache / "weights").glob("*/*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 1
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    got = _tiles(load(str(tiny_gguf), quant="kq"))
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    err = [ln for ln in capsys.readouterr().err.splitlines() if "damaged" in ln]
    assert len(err) == 1 and "sha256" in err[0] and str(entry) in err[0]
    assert entry.read_bytes() != bytes(data)  # made again and kept


def test_the_first_big_entry_made_says_so_once(cache, capsys, monkeypatch):
    monkeypatch.setattr(store, "_warned", set())
    monkeypatch.setattr(store, "ANNOUNCE_BYTES", 1000)
    for i in range(3):
        store.cached("t", [np.full(1000, i, np.int8)], lambda: np.zeros(1))
    store.cached("t", [np.full(1000, 0, np.int8)], lambda: np.zeros(1))  # read back: nothing said
    said = [ln for ln in capsys.readouterr().err.splitlines() if "packing weights" in ln]
    assert len(said) == 1 and str(cache / "weights") in said[0]


def test_a_truncated_entry_is_made_again(cache, capsys):
    a = np.arange(5000, dtype=np.int32)
    store.cached("t", [a], lambda: a * 2)
    (entry,) = (cache / "weights").glob("*/*.bin")
    entry.write_bytes(entry.read_bytes()[:-4])
    assert np.array_equal(store.cached("t", [a], lambda: a * 2), a * 2)
    assert "damaged" in capsys.readouterr().err


def test_an_entry_is_keyed_by_its_sources_bytes_and_its_tag(cache):
    a = np.arange(10000, dtype=np.int32)
    made = []

    def make(tag):
        return lambda: made.append(tag) or np.full(3, len(made))

    first = store.cached("x", [a], make("x"))
    assert np.array_equal(store.cached("x", [a.copy()], make("again")), first)  # same bytes: read
    b = a.copy()
    b[1234] += 1
    store.cached("x", [b], make("one value differs"))
    store.cached("y", [a], make("another tag"))
    store.cached("x", [a.view(np.float32)], make("another dtype"))
    assert made == ["x", "one value differs", "another tag", "another dtype"]


def test_the_digest_is_the_sha256_of_its_pieces_sha256s(cache):
    import hashlib

    a = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 7, dtype=np.uint8)
    pieces = [hashlib.sha256(a[i : i + 4096]).digest() for i in range(0, a.size, 4096)]
    assert store.digest(a) == hashlib.sha256(b"".join(pieces)).hexdigest()
    assert store.digest(a[:4096]) == hashlib.sha256(a[:4096]).hexdigest()


def test_a_cache_it_cannot_write_costs_one_line_and_nothing_else(tmp_path, tiny_gguf, monkeypatch, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECDECODE_CACHE", str(blocker))
    monkeypatch.setenv("SPECDECODE_WEIGHT_CACHE", "1")
    monkeypatch.setattr(store, "MIN_BYTES", 0)
    monkeypatch.setattr(store, "_warned", set())
    want = [np.arange(3)]
    for _ in range(3):
        assert np.array_equal(store.cached("t", [np.arange(100)], lambda: want[0]), want[0])
    err = [ln for ln in capsys.readouterr().err.splitlines() if "cannot keep" in ln]
    assert len(err) == 1 and "SPECDECODE_CACHE" in err[0]


def test_a_changed_gguf_gets_a_new_index(cache, tmp_path):
    from helpers import write_tiny_qwen_gguf
    from specdecode.models.gguf_quant import gguf_index

    _, path = write_tiny_qwen_gguf(tmp_path / "a", seed=1)
    before = gguf_index(path)
    import os

    os.utime(path, ns=(1, 1))  # the same bytes, another modification time: parsed again
    after = gguf_index(path)
    assert after["key"] != before["key"] and after["tensors"] == before["tensors"]
    assert len(list((cache / "gguf-files").glob("*.json"))) == 2


def test_entries_unused_for_a_month_go_when_a_process_writes_one(cache, monkeypatch, capsys):
    import os
    import time

    old, used = np.arange(5000, dtype=np.int32), np.arange(6000, dtype=np.int32)
    store.cached("t", [old], lambda: old)
    store.cached("t", [used], lambda: used)
    month = time.time() - 40 * 86400
    for meta in (cache / "weights").glob("*/*.json"):
        os.utime(meta, (month, month))
    store.cached("t", [used], lambda: pytest.fail("made again"))  # a read marks it used
    monkeypatch.setattr(store, "_warned", set())  # a new process
    store.cached("t", [np.arange(7000, dtype=np.int32)], lambda: np.zeros(1))
    assert len(list((cache / "weights").glob("*/*.json"))) == 2  # the read one and the new one
    assert len(list((cache / "weights").glob("*/*.bin"))) == 2
    said = [ln for ln in capsys.readouterr().err.splitlines() if "removed" in ln]
    assert len(said) == 1 and "1 packed-weight entries unused for 30 days" in said[0]
    made = []
    store.cached("t", [old], lambda: made.append(1) or old)
    assert made == [1]  # gone: made again
