"""Compiled CuTe-DSL kernels of the cuDNN DSA wrappers kept across processes and runs.

cudnn-frontend 1.32.0's DSA wrappers compile every kernel with ``cute.compile(..., options="--enable-tvm-ffi ...")``
on first use and keep the result only in module-level dicts keyed by the kernel's compile key (dtype, head count, head
dim, index width, flags — never token counts; ``notes`` in the README). ``cute.compile`` forces the DSL's own file
cache off, and the DSA modules do not use cudnn-frontend's persistent ``frost.compiled_cache``, so every process pays
every compile again (5-17 s per key on an H200). This module replaces those dicts with :class:`PersistentCompileCache`
— a dict with the same keys whose misses are looked up on disk first and whose compiled objects are exported
(``export_to_c``, a tvm-ffi object file) and reloaded (``cutlass.runtime.load_module``) in later processes.

Safety rules (a cache can never change a result):

* **Same key, same kernel.** An entry is used only for the exact wrapper compile key it was stored under (its
  ``repr``, compared on load) in the same cache namespace (module + dict) — the key the wrapper itself trusts to reuse
  one compiled object for every call in a process. Keys that are not plain values (ints, floats, bools, strings,
  None, types, torch dtypes, tuples of them) stay in memory only.
* **Same environment.** Entries live under a directory named by the digest of the environment manifest:
  cudnn-frontend's own (frontend version and a digest of the whole installed ``cudnn`` package source, CUTLASS DSL
  and tvm-ffi versions, CUDA driver, device name / compute capability / SM count / L2 size), plus torch and Python
  versions, every ``CUTE_DSL_*`` variable and this module's source. Any change is a different directory; a field that
  cannot be read disables persistence.
* **Corruption is a miss.** ``entry.json`` (written last, the commit marker) records the object's SHA-256; an entry
  whose record or object does not match, or whose object fails to load, is deleted and the kernel compiled again.
  A miss compiles, exports and hands out the *reloaded* object, so a cold and a warm run execute the same artifact.

Location: ``$DSV4_PARITY_CACHE_DIR`` (default ``~/.cache/dsv4-parity``), kernels under ``dsa-kernels/``;
:func:`configure_environment` also points the CUTLASS DSL, cudnn-frontend, Triton and TorchInductor caches there.
Clear it with ``dsv4-parity cache --clear`` (or ``make clean-cache``). ``DSV4_PARITY_KERNEL_CACHE=0`` turns
persistence off (compiles are still counted). Concurrent processes (``--workers``) share entries: a process that
misses takes a per-entry file lock while it compiles, the others wait for it (at most ``LOCK_WAIT_S``) and load;
a lock whose compile raised is released at the process's next lookup.

Instrumentation: :func:`stats` counts, per namespace, compiles (and their seconds: miss to store, i.e. the DSL
trace + compile), loads, memory hits and rejected entries; with ``$DSV4_PARITY_COMPILE_STATS`` set to a directory
every process keeps ``<pid>.json`` there up to date (``dsv4-parity bench --sections gate`` sums them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ENV_DIR = "DSV4_PARITY_CACHE_DIR"
ENV_SWITCH = "DSV4_PARITY_KERNEL_CACHE"
ENV_STATS = "DSV4_PARITY_COMPILE_STATS"
SCHEMA = 1
OBJECT, RECORD, MANIFEST = "kernel.o", "entry.json", "manifest.json"
LOCK_WAIT_S = 90.0  # the longest single compile measured is 17 s

_DSA = "cudnn.deepseek_sparse_attention."
#: (module, attribute path of its compile-cache dict, namespace) of every DSA compile site on sm90 (and shared ones).
DSA_CACHES = (
    (_DSA + "indexer_forward._interface_sm90", "_compile_cache", "indexer_forward"),
    (_DSA + "indexer_top_k.indexer_top_k_decode_varlen", "_compile_cache", "indexer_top_k"),
    (_DSA + "indexer_top_k.compactify", "_compile_cache", "compactify"),
    (_DSA + "indexer_top_k.local_to_global_dsl", "_compile_cache", "local_to_global"),
    (_DSA + "sparse_attention_backward._interface_sm90", "flash_attn_bwd_sm90.compile_cache_pre",
     "sparse_attn_bwd.preprocess"),
    (_DSA + "sparse_attention_backward._interface_sm90", "flash_attn_bwd_sm90.compile_cache", "sparse_attn_bwd"),
    (_DSA + "sparse_attention_backward._interface_sm90", "flash_attn_bwd_sm90.compile_cache_post",
     "sparse_attn_bwd.postprocess"),
    (_DSA + "score_recompute._interface_sm90", "_sparse_score_recompute.compile_cache", "sparse_score_recompute"),
    (_DSA + "score_recompute._interface_sm90", "_dense_score_recompute.compile_cache", "dense_score_recompute"),
    (_DSA + "indexer_backward.indexer_backward_sm90", "_compile_cache", "indexer_backward"),
    (_DSA + "indexer_backward.indexer_backward_sm90", "_score_grad_cute_cache", "indexer_backward.score_grad"),
    (_DSA + "indexer_backward.dense_indexer_backward_sm90", "_dense_compile_cache", "dense_indexer_backward"),
    (_DSA + "indexer_backward.dense_indexer_backward_sm90", "_dense_score_grad_compile_cache",
     "dense_indexer_backward.score_grad"),
)

_LOCK = threading.Lock()
_STATS: dict[str, dict[str, float]] = {}
_HELD: dict[str, Any] = {}          # lock path -> open file: entries this process is compiling
_LOADED: list[Any] = []             # reloaded modules, kept alive for the process
_STORE: list[Optional[Path]] = []   # the resolved kernel directory (one per process), [] = not resolved yet
_WHY_OFF: list[str] = []            # why this process persists nothing (empty: it does, or not resolved yet)


# ---- location and environment ---------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``$DSV4_PARITY_CACHE_DIR`` or ``~/.cache/dsv4-parity``."""
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "dsv4-parity").expanduser()


def persistence_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def configure_environment(root: Optional[Path] = None) -> dict[str, str]:
    """Point the libraries' own compile caches under the project's root (only variables the user has not set);
    call before ``cutlass`` / ``triton`` are imported. Returns what it set."""
    root = Path(root) if root is not None else cache_root()
    wanted = {"CUTE_DSL_CACHE_DIR": root / "cute-dsl", "CUDNN_FRONTEND_COMPILED_CACHE": root / "cudnn-frontend",
              "TRITON_CACHE_DIR": root / "triton", "TORCHINDUCTOR_CACHE_DIR": root / "inductor"}
    set_now = {k: str(v) for k, v in wanted.items() if not os.environ.get(k)}
    os.environ.update(set_now)
    return set_now


def clear(root: Optional[Path] = None) -> list[Path]:
    """Delete every cache this module set up under ``root`` (default :func:`cache_root`); returns what was removed."""
    root = Path(root) if root is not None else cache_root()
    removed = []
    for name in ("dsa-kernels", "cute-dsl", "cudnn-frontend", "triton", "inductor", ".locks"):
        path = root / name
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    _STORE.clear()
    return removed


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def library_manifest() -> dict[str, str]:
    """cudnn-frontend's environment manifest (versions, package source digest, driver, device)."""
    from cudnn.frost.compiled_cache import environment_manifest  # noqa: PLC0415 - GPU-only dependency

    return {k: str(v) for k, v in environment_manifest().items()}


def environment_manifest() -> dict[str, str]:
    """Everything a compiled object depends on, as strings (see the module docstring)."""
    import torch  # noqa: PLC0415

    manifest = dict(library_manifest())
    manifest.update({"dsv4_schema": str(SCHEMA), "torch": torch.__version__, "python": sys.version.split()[0],
                     "cute_dsl_env": json.dumps({k: v for k, v in sorted(os.environ.items())
                                                 if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_CACHE_DIR"}),
                     "compile_cache_source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]})
    return manifest


def kernel_store() -> Optional[Path]:
    """This environment's entry directory, or ``None`` when persistence is off or the environment cannot identify
    itself (then nothing is stored or loaded)."""
    if not persistence_enabled():
        return None
    with _LOCK:
        if _STORE:
            return _STORE[0]
    why = ""
    try:
        manifest = environment_manifest()
        unknown = sorted(k for k, v in manifest.items() if v == "unknown")
        why = f"the environment cannot identify itself ({', '.join(unknown)} unknown)" if unknown else ""
        store = None if unknown else \
            cache_root() / "dsa-kernels" / f"v{SCHEMA}" / _digest(json.dumps(manifest, sort_keys=True))
        if store is not None:
            store.mkdir(parents=True, exist_ok=True)
            if not (store / MANIFEST).exists():
                _write_atomic(store / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    except Exception as exc:  # noqa: BLE001 - persistence is optional: compile as before
        why, store = f"{type(exc).__name__}: {exc}", None
    if why:
        print(f"dsv4-parity: compiled-kernel cache off: {why}", file=sys.stderr)
    with _LOCK:
        _STORE[:] = [store]
        _WHY_OFF[:] = [why] if why else []
    return store


# ---- keys, files ----------------------------------------------------------------------------------------------------
def key_text(key: Any) -> Optional[str]:
    """``repr(key)`` if it names the same kernel in another process (plain values only), else ``None``."""
    import torch  # noqa: PLC0415

    def plain(v: Any) -> bool:
        if v is None or isinstance(v, (bool, int, float, str, type, torch.dtype)):
            return True
        return isinstance(v, tuple) and all(plain(x) for x in v)

    return repr(key) if plain(key) else None


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the artifact: export, calling convention, reload (the only code that touches the DSL) -------------------------
def calling_convention(compiled: Any) -> Optional[dict]:
    """How a reloaded object must be called to behave as ``compiled``: ``{"positional": True}`` for a positional
    tvm-ffi function, the DSL's kwargs-wrapper spec for one with keywords / defaults, ``None`` when it cannot be
    reproduced exactly (raw pointer arguments, no export, a calling convention the spec cannot carry)."""
    if not hasattr(compiled, "export_to_c"):
        return None
    if getattr(getattr(compiled, "execution_args", None), "has_pointer_address_arg_specs", False):
        return None
    if getattr(compiled, "_kwargs_wrapper", None) is not None:
        from cudnn.frost.compiled_cache import _wrapper_spec_of  # noqa: PLC0415

        spec = _wrapper_spec_of(compiled, (), {})
        return None if spec is None else {"kwargs": spec}
    import tvm_ffi  # noqa: PLC0415

    return {"positional": True} if isinstance(compiled, tvm_ffi.Function) else None


def symbol_of(namespace: str) -> str:
    """The exported function name of a namespace's kernels (one per kernel family, as cudnn-frontend's own cache)."""
    return "dsv4_" + "".join(ch if ch.isalnum() else "_" for ch in namespace)


def export_object(compiled: Any, path: Path, symbol: str) -> None:
    compiled.export_to_c(str(path), function_name=symbol)


def load_object(path: Path, symbol: str, convention: dict) -> Callable:
    """The callable of an exported object, called like the in-process one (``convention``)."""
    import cutlass  # noqa: PLC0415

    module = cutlass.runtime.load_module(str(path), enable_tvm_ffi=True)
    _LOADED.append(module)
    raw = getattr(module, symbol)
    if convention.get("positional"):
        return raw
    from cudnn.frost.compiled_cache import _rebuild_wrapper  # noqa: PLC0415

    wrapper = _rebuild_wrapper(raw, convention["kwargs"])
    if wrapper is None:
        raise ValueError("the recorded kwargs spec cannot be rebuilt")
    return wrapper


# ---- stats ------------------------------------------------------------------------------------------------------------
def _count(namespace: str, name: str, value: float = 1.0) -> None:
    with _LOCK:
        row = _STATS.setdefault(namespace, {"compiled": 0, "compile_s": 0.0, "loaded": 0, "load_s": 0.0,
                                            "wait_s": 0.0, "memory_hits": 0, "rejected": 0, "not_persisted": 0})
        row[name] = row.get(name, 0) + value


def stats() -> dict[str, dict[str, float]]:
    """Per namespace: ``compiled`` / ``compile_s``, ``loaded`` / ``load_s``, ``wait_s`` (waiting for a peer's compile
    lock), ``memory_hits``, ``rejected`` (entries found but not usable), ``not_persisted`` (compiled objects that
    could not be stored)."""
    with _LOCK:
        return {ns: dict(row) for ns, row in _STATS.items()}


def flush_stats() -> Optional[Path]:
    """Write this process's :func:`stats` to ``$DSV4_PARITY_COMPILE_STATS/<pid>.json`` (if set)."""
    target = os.environ.get(ENV_STATS)
    if not target:
        return None
    path = Path(target) / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK:
        store, off = (str(_STORE[0]) if _STORE and _STORE[0] else None), list(_WHY_OFF)
    doc = {"pid": os.getpid(), "stats": stats(), "store": store, "off": off[0] if off else None}
    _write_atomic(path, json.dumps(doc, sort_keys=True).encode())
    return path


def merge_stats(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Sum the per-process :func:`stats` documents (``{"stats": {...}}``) by namespace and counter."""
    total: dict[str, dict[str, float]] = {}
    for doc in rows:
        for ns, row in (doc.get("stats") or {}).items():
            acc = total.setdefault(ns, {})
            for name, value in row.items():
                acc[name] = round(acc.get(name, 0) + value, 3)
    return total


# ---- locks ------------------------------------------------------------------------------------------------------------
def _lock_path(entry: Path) -> Path:
    return cache_root() / ".locks" / f"{entry.parent.name}-{entry.name}.lock"


def _claim(entry: Path, wait_s: float) -> bool:
    """Take the entry's compile lock (waiting for a peer that holds it, at most ``wait_s``). ``False``: not taken."""
    try:
        import fcntl  # noqa: PLC0415
    except ImportError:
        return False
    path = _lock_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+b")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            with _LOCK:
                _HELD[str(path)] = handle
            return True
        except OSError:
            if time.monotonic() >= deadline:
                handle.close()
                return False
            time.sleep(0.05)


def release_locks() -> None:
    """Release every compile lock this process holds (a compile that raised leaves its lock until the next miss)."""
    with _LOCK:
        held = list(_HELD.values())
        _HELD.clear()
    for handle in held:
        with contextlib.suppress(OSError):
            handle.close()


def _release(entry: Path) -> None:
    with _LOCK:
        handle = _HELD.pop(str(_lock_path(entry)), None)
    if handle is not None:
        with contextlib.suppress(OSError):
            handle.close()


# ---- the dict -------------------------------------------------------------------------------------------------------
class PersistentCompileCache(dict):
    """A DSA wrapper's compile-cache dict whose misses are served from disk when an entry exists (see the module
    docstring). The wrappers use ``key in cache``, ``cache[key] = compiled``, ``cache[key]`` and ``cache.get(key)``;
    a compile happens between a missed ``in`` and the store."""

    def __init__(self, namespace: str, wait_s: float = LOCK_WAIT_S):
        super().__init__()
        self.namespace = namespace
        self.wait_s = wait_s
        self._started: dict[Any, float] = {}

    def _entry(self, key: Any) -> Optional[Path]:
        text = key_text(key)
        store = kernel_store() if text is not None else None
        return None if store is None else store / _digest(f"{self.namespace}|{text}")

    def __contains__(self, key: Any) -> bool:
        release_locks()  # a lock still held here belongs to a compile that raised: let the peers go on
        if dict.__contains__(self, key):
            _count(self.namespace, "memory_hits")
            return True
        entry = self._entry(key)
        if entry is not None:
            if self._load(key, entry):
                return True
            waited = time.perf_counter()
            claimed = _claim(entry, self.wait_s)
            _count(self.namespace, "wait_s", time.perf_counter() - waited)
            if claimed and self._load(key, entry):  # a peer published it while we waited
                _release(entry)
                return True
        self._started[key] = time.perf_counter()
        return False

    def get(self, key: Any, default: Any = None) -> Any:
        return dict.__getitem__(self, key) if key in self else default

    def __getitem__(self, key: Any) -> Any:
        if not dict.__contains__(self, key):
            self.__contains__(key)
        return dict.__getitem__(self, key)

    def __setitem__(self, key: Any, compiled: Any) -> None:
        started = self._started.pop(key, None)
        if started is not None:
            _count(self.namespace, "compiled")
            _count(self.namespace, "compile_s", time.perf_counter() - started)
        entry = self._entry(key)
        obj = compiled
        if entry is None and key_text(key) is None and persistence_enabled():
            _count(self.namespace, "not_persisted")  # a key that cannot name the kernel in another process
        if entry is not None:
            try:
                obj = self._store(key, entry, compiled) or compiled
            finally:
                _release(entry)
        dict.__setitem__(self, key, obj)
        flush_stats()

    # ---- disk ------------------------------------------------------------------------------------------------------
    def _load(self, key: Any, entry: Path, hit: bool = True) -> bool:
        """Serve ``key`` from ``entry`` (``hit``: count it as a load; ``False`` after a store)."""
        record_path, object_path = entry / RECORD, entry / OBJECT
        if not record_path.is_file():
            return False
        start = time.perf_counter()
        try:
            record = json.loads(record_path.read_text())
            if (record.get("schema") != SCHEMA or record.get("namespace") != self.namespace
                    or record.get("key") != key_text(key) or record.get("symbol") != symbol_of(self.namespace)):
                raise ValueError("the entry's record names another kernel")
            if _sha256(object_path) != record.get("sha256"):
                raise ValueError("the object file does not match its recorded SHA-256")
            fn = load_object(object_path, record["symbol"], record["convention"])
        except Exception as exc:  # noqa: BLE001 - a stale, foreign or corrupt entry is a miss
            _count(self.namespace, "rejected")
            print(f"dsv4-parity: compiled-kernel cache entry {entry} rejected ({type(exc).__name__}: {exc}); "
                  "compiling", file=sys.stderr)
            shutil.rmtree(entry, ignore_errors=True)
            return False
        dict.__setitem__(self, key, fn)
        if hit:
            _count(self.namespace, "loaded")
            _count(self.namespace, "load_s", time.perf_counter() - start)
            flush_stats()
        return True

    def _store(self, key: Any, entry: Path, compiled: Any) -> Optional[Callable]:
        """Export ``compiled`` and return its reloaded callable (``None``: not persisted, use ``compiled``)."""
        try:
            convention = calling_convention(compiled)
            if convention is None:
                _count(self.namespace, "not_persisted")
                return None
            entry.mkdir(parents=True, exist_ok=True)
            tmp = entry / f".{OBJECT}.{os.getpid()}.tmp"
            export_object(compiled, tmp, symbol_of(self.namespace))
            os.replace(tmp, entry / OBJECT)
            record = {"schema": SCHEMA, "namespace": self.namespace, "key": key_text(key),
                      "symbol": symbol_of(self.namespace),
                      "convention": convention, "sha256": _sha256(entry / OBJECT)}
            _write_atomic(entry / RECORD, json.dumps(record, indent=1, sort_keys=True).encode())
        except Exception as exc:  # noqa: BLE001 - persistence is best effort; the kernel is compiled either way
            _count(self.namespace, "not_persisted")
            print(f"dsv4-parity: could not store compiled kernel {entry} ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        if self._load(key, entry, hit=False):  # hand out the artifact a later process will load: cold == warm
            return dict.__getitem__(self, key)
        return None


# ---- installation -----------------------------------------------------------------------------------------------------
def _resolve(module: Any, path: str) -> tuple[Any, str]:
    *owners, attr = path.split(".")
    for name in owners:
        module = getattr(module, name)
    return module, attr


def install() -> list[str]:
    """Replace the DSA modules' compile-cache dicts by :class:`PersistentCompileCache` (idempotent; modules that do
    not import are skipped). Returns the namespaces installed now or before."""
    import importlib  # noqa: PLC0415

    done = []
    for module_name, path, namespace in DSA_CACHES:
        try:
            owner, attr = _resolve(importlib.import_module(module_name), path)
            current = getattr(owner, attr)
        except Exception:  # noqa: BLE001 - another frontend version or an architecture without this module
            continue
        if not isinstance(current, PersistentCompileCache):
            cache = PersistentCompileCache(namespace)
            dict.update(cache, current)
            setattr(owner, attr, cache)
        done.append(namespace)
    return done
