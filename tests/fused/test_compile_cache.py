"""The persistent compiled-kernel cache (fused/kernels/compile_cache.py) on the CPU: a fake "kernel" (a callable
multiplying by a factor) stands for a compiled CuTe-DSL object, its export is a small text file, and a fresh
:class:`PersistentCompileCache` (with the process-wide store resolution reset) stands for a new process."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from fused.kernels import compile_cache as cc


class FakeKernel:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, x):
        return x * self.factor

    def export_to_c(self, path, function_name=None):
        assert function_name == cc.symbol_of("ns") or function_name.startswith("dsv4_")
        with open(path, "w") as f:
            f.write(f"factor={self.factor}")


def _fake_load(path, symbol, convention):
    text = open(path).read()
    if not text.startswith("factor="):
        raise ValueError("not an object file")
    return FakeKernel(float(text.split("=", 1)[1]))


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cc.ENV_SWITCH, raising=False)
    monkeypatch.delenv(cc.ENV_STATS, raising=False)
    manifest = {"cudnn_frontend": "1.32.0", "cudnn_source": "abc", "cutlass_dsl": "4.8.1", "device_name": "H200"}
    monkeypatch.setattr(cc, "library_manifest", lambda: dict(manifest))
    monkeypatch.setattr(cc, "calling_convention",
                        lambda c: {"positional": True} if hasattr(c, "export_to_c") else None)
    monkeypatch.setattr(cc, "load_object", _fake_load)
    monkeypatch.setattr(cc, "_STATS", {})
    monkeypatch.setattr(cc, "_STORE", [])
    monkeypatch.setattr(cc, "_WHY_OFF", [])
    yield manifest
    cc.release_locks()


def new_process():
    """Forget what this 'process' resolved (the store directory, the held locks)."""
    cc._STORE.clear()
    cc.release_locks()


def run(cache, key, x, compiles):
    """What a DSA wrapper does: compile on a miss, then call the cached object."""
    if key not in cache:
        compiles.append(key)
        cache[key] = FakeKernel(key[1])
    return cache[key](x)


KEY = (torch.bfloat16, 3.0, 128, True)


def test_cold_compiles_and_stores_warm_loads_without_compiling(env):
    compiles = []
    cold = cc.PersistentCompileCache("ns")
    assert run(cold, KEY, 2.0, compiles) == 6.0 and len(compiles) == 1
    assert run(cold, KEY, 2.0, compiles) == 6.0 and len(compiles) == 1  # memory hit
    entries = list((cc.cache_root() / "dsa-kernels").rglob(cc.RECORD))
    assert len(entries) == 1 and json.loads(entries[0].read_text())["key"] == repr(KEY)
    new_process()
    warm = cc.PersistentCompileCache("ns")
    assert run(warm, KEY, 2.0, compiles) == 6.0 and len(compiles) == 1  # loaded, not compiled
    s = cc.stats()["ns"]
    assert s["compiled"] == 1 and s["loaded"] == 1 and s["memory_hits"] >= 1 and s["compile_s"] >= 0


def test_a_miss_hands_out_the_reloaded_artifact(env):
    cache = cc.PersistentCompileCache("ns")
    compiled = FakeKernel(3.0)
    assert KEY not in cache
    cache[KEY] = compiled
    assert dict.__getitem__(cache, KEY) is not compiled and cache[KEY](1.0) == 3.0


def test_other_key_namespace_or_environment_is_a_miss(env):
    compiles = []
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles)
    new_process()
    run(cc.PersistentCompileCache("other"), KEY, 1.0, compiles)  # same key, another dict: another kernel
    run(cc.PersistentCompileCache("ns"), KEY[:-1] + (False,), 1.0, compiles)
    assert len(compiles) == 3
    env["cudnn_source"] = "edited"  # an edited cudnn package: a new environment directory
    new_process()
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles)
    assert len(compiles) == 4
    assert len(list((cc.cache_root() / "dsa-kernels" / f"v{cc.SCHEMA}").iterdir())) == 2


def _entry_dir():
    (record,) = list((cc.cache_root() / "dsa-kernels").rglob(cc.RECORD))
    return record.parent


def test_corrupt_object_is_rejected_and_recompiled(env):
    compiles = []
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles)
    (_entry_dir() / cc.OBJECT).write_text("factor=5.0")  # a loadable but different kernel
    new_process()
    cache = cc.PersistentCompileCache("ns")
    assert run(cache, KEY, 1.0, compiles) == 3.0 and len(compiles) == 2
    assert cc.stats()["ns"]["rejected"] == 1
    assert (_entry_dir() / cc.OBJECT).read_text() == "factor=3.0"  # rewritten


def test_corruption_check_has_teeth(env, monkeypatch):
    """Negative control: without the SHA-256 comparison the corrupted object is served and the result changes."""
    compiles = []
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles)
    record = json.loads((_entry_dir() / cc.RECORD).read_text())
    (_entry_dir() / cc.OBJECT).write_text("factor=5.0")
    monkeypatch.setattr(cc, "_sha256", lambda path: record["sha256"])
    new_process()
    assert run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles) == 5.0 and len(compiles) == 1


@pytest.mark.parametrize("damage", ["truncated", "foreign record", "unloadable", "no object"])
def test_damaged_entries_are_misses(env, damage):
    compiles = []
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles)
    entry = _entry_dir()
    if damage == "truncated":
        (entry / cc.RECORD).write_text('{"schema": 1, "key"')
    elif damage == "foreign record":
        record = json.loads((entry / cc.RECORD).read_text())
        (entry / cc.RECORD).write_text(json.dumps(dict(record, key=repr(("another",)))))
    elif damage == "unloadable":
        (entry / cc.OBJECT).write_text("garbage")
        record = json.loads((entry / cc.RECORD).read_text())
        (entry / cc.RECORD).write_text(json.dumps(dict(record, sha256=cc._sha256(entry / cc.OBJECT))))
    else:
        (entry / cc.OBJECT).unlink()
    new_process()
    assert run(cc.PersistentCompileCache("ns"), KEY, 2.0, compiles) == 6.0 and len(compiles) == 2


def test_keys_that_are_not_plain_values_stay_in_memory(env):
    compiles = []
    key = (object(), 3.0)
    assert cc.key_text(key) is None and cc.key_text(KEY) == repr(KEY)
    run(cc.PersistentCompileCache("ns"), key, 1.0, compiles)
    assert not list(cc.cache_root().rglob(cc.RECORD)) and cc.stats()["ns"]["not_persisted"] == 1


@pytest.mark.parametrize("why", ["switched off", "unknown field", "not exportable"])
def test_no_persistence_when_off_or_unidentifiable(env, monkeypatch, why):
    if why == "switched off":
        monkeypatch.setenv(cc.ENV_SWITCH, "0")
    elif why == "unknown field":
        env["device_name"] = "unknown"
    else:
        monkeypatch.setattr(cc, "calling_convention", lambda c: None)
    compiles = []
    assert run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles) == 3.0
    if why == "unknown field":
        assert "device_name unknown" in cc._WHY_OFF[0]
    new_process()
    assert run(cc.PersistentCompileCache("ns"), KEY, 1.0, compiles) == 3.0 and len(compiles) == 2
    assert not list(cc.cache_root().rglob(cc.RECORD))


def test_a_peer_holding_the_compile_lock_delays_then_compiles(env):
    """A peer compiling the same entry holds its lock: this process waits (here 0.2 s), then compiles anyway; after
    the store its own lock is released (a third process can take it at once)."""
    import fcntl

    compiles = []
    cache = cc.PersistentCompileCache("ns", wait_s=0.2)
    entry = cache._entry(KEY)
    entry.parent.mkdir(parents=True, exist_ok=True)
    peer = cc._lock_path(entry)
    peer.parent.mkdir(parents=True, exist_ok=True)
    with peer.open("a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        assert run(cache, KEY, 1.0, compiles) == 3.0 and len(compiles) == 1
    assert cc.stats()["ns"]["wait_s"] >= 0.2
    with peer.open("a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if still held


def test_stats_files_and_merge(env, tmp_path, monkeypatch):
    monkeypatch.setenv(cc.ENV_STATS, str(tmp_path / "stats"))
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, [])
    (path,) = list((tmp_path / "stats").glob("*.json"))
    doc = json.loads(path.read_text())
    assert doc["stats"]["ns"]["compiled"] == 1 and doc["store"] and doc["off"] is None
    merged = cc.merge_stats([doc, doc])
    assert merged["ns"]["compiled"] == 2


def test_install_replaces_the_wrappers_dicts_once_and_keeps_their_entries(env, monkeypatch):
    module = types.ModuleType("fake_dsa_interface")
    module._compile_cache = {("k",): "compiled-before"}

    def flash_attn_bwd():
        pass

    flash_attn_bwd.compile_cache = {}
    module.flash_attn_bwd = flash_attn_bwd
    monkeypatch.setitem(sys.modules, "fake_dsa_interface", module)
    monkeypatch.setattr(cc, "DSA_CACHES", (("fake_dsa_interface", "_compile_cache", "a"),
                                           ("fake_dsa_interface", "flash_attn_bwd.compile_cache", "b"),
                                           ("not_installed_module", "_compile_cache", "c")))
    assert cc.install() == ["a", "b"]
    first = module._compile_cache
    assert isinstance(first, cc.PersistentCompileCache) and first.namespace == "a"
    assert isinstance(module.flash_attn_bwd.compile_cache, cc.PersistentCompileCache)
    assert ("k",) in first and first[("k",)] == "compiled-before"
    assert cc.install() == ["a", "b"] and module._compile_cache is first


def test_configure_environment_keeps_the_users_settings(env, monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    for name in ("CUTE_DSL_CACHE_DIR", "CUDNN_FRONTEND_COMPILED_CACHE", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    set_now = cc.configure_environment(tmp_path / "root")
    assert "TRITON_CACHE_DIR" not in set_now and set_now["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "root" / "cute-dsl")


def test_clear_removes_the_cache(env):
    run(cc.PersistentCompileCache("ns"), KEY, 1.0, [])
    assert cc.clear() and not (cc.cache_root() / "dsa-kernels").exists()
