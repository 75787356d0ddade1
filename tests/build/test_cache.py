"""The build cache alone (no compiler): store, hit, corrupt entry removed."""

import json

from flamia_gen.build.cache import BuildCache, cache_key, sha256_file


def test_store_lookup_and_corrupt_entry(tmp_path):
    cache = BuildCache(tmp_path / "cache")
    so = tmp_path / "x.so"
    so.write_bytes(b"\x7fELF fake shared object")
    key = cache_key("source", "sm_90a")
    assert cache.lookup("v", "sm_90a", key) == (None, "miss")
    e = cache.store("v", "sm_90a", key, so, {"uses": ["r.q"]})
    assert e.so.read_bytes() == so.read_bytes()
    rec = json.loads(e.record.read_text())
    assert rec["sha256"] == sha256_file(so) and rec["key"] == key and rec["uses"] == ["r.q"]
    assert not list(e.so.parent.glob(".tmp-*"))  # temp files renamed away
    hit, why = cache.lookup("v", "sm_90a", key)
    assert hit == e and why == ""
    e.so.write_bytes(b"garbage")
    assert cache.lookup("v", "sm_90a", key) == (None, "corrupt entry removed")
    assert not e.so.exists() and not e.record.exists()
    assert cache_key("source ", "sm_90a") != key != cache_key("source", "sm_100a")
