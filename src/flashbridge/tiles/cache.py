"""The tuning cache: the fastest measured tile per GPU, Triton version, kernel and shape bucket, as JSON.

An entry's key is ``"<gpu name>|sm<capability>|triton <version>|<kernel>|<shape bucket>"`` and its value
``{"tile": [block_m, block_n, num_warps, num_stages], "ms": ..., ...}``. Lookups read the user cache first
(``$FLASHBRIDGE_CACHE``, else ``$XDG_CACHE_HOME/flashbridge``, else ``~/.cache/flashbridge``; the file
``tiles.json`` there), then the entries shipped in the package (``flashbridge/tiles/data/tiles.json``);
without an entry -- or with an unreadable file -- the resource model's choice is used: never a crash.

Writes are safe with several processes tuning at once: under an exclusive ``fcntl`` lock on a side file,
the writer re-reads the file, merges its entries over what it finds (other processes' entries survive),
writes a temporary file in the same folder and renames it over the old one (``os.replace``: readers see
the old file or the new one, never half of one). The same entries serve torch and JAX: the choice is made
from shapes before any launch.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from ..core_kernels._plan import Target, cdiv, next_power_of_2
from .model import MODELS, OPS, AttnCase, DecodeCase, RowsCase, Tile, build_report
from .profiles import GPUProfile

CACHE_ENV = "FLASHBRIDGE_CACHE"
FILE_NAME = "tiles.json"
SCHEMA = 1


def user_cache_dir() -> Path:
    """Where tuned entries are written: ``$FLASHBRIDGE_CACHE``, ``$XDG_CACHE_HOME/flashbridge`` or
    ``~/.cache/flashbridge``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashbridge"


def user_cache_file() -> Path:
    return user_cache_dir() / FILE_NAME


def shipped_file() -> Path:
    return Path(__file__).parent / "data" / FILE_NAME


@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    import triton

    return triton.__version__


def length_bucket(n: int) -> str:
    """The length part of a bucket: lengths grouped by powers of four from 1K (1k, 4k, 16k, 64k, ...); the
    plans and :func:`bucket_parts` both build their keys with it."""
    b = 1024
    while b < n:
        b *= 4
    return f"{b // 1024}k"


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in v.replace("+", ".").split("."))


# ------------------------------------------------------------------------------------------- shape buckets

def attention_class(head_dim: int, dtype: str, kind: str, gqa: bool, split: int = 1) -> str:
    """The length-free bucket of an attention kernel's call: the padded head dim (the larger of Dqk, Dv)
    rounded up to 64, 128 or 256, the dtype, the masking ("full", "causal", "local" (a window) or "sparse"
    (a block mask without either)), "mha" or "gqa", and "-split2" for a column-split dK/dV kernel."""
    d = max(16, next_power_of_2(head_dim))
    d = 64 if d <= 64 else 128 if d <= 128 else 256
    return f"d{d}-{dtype}-{kind}-{'gqa' if gqa else 'mha'}" + (f"-split{split}" if split > 1 else "")


def attention_kind(options, sparse: bool = False) -> str:
    return "causal" if options.causal else "local" if options.has_local else "sparse" if sparse else "full"


def decode_class_of(case, gpu: GPUProfile) -> str:
    """The decode plan's shape class (``decode.plan.decode_class``) of a model case."""
    from ..core_kernels.decode.plan import decode_class

    s = case.shape
    return decode_class(s.seqlen_q * s.group, s.head_dim_qk, s.head_dim_v, s.dtype, s.cache, s.batch * s.heads_kv,
                        s.cache.capacity, Target(False, gpu.sms, gpu))


def ce_class(rows: int, vocab: int, num_sms: int) -> str:
    """Cross-entropy's bucket: the padded vocabulary and "few" rows (under two programs per SM at the
    default 4096-element tiles) or "many"."""
    v = next_power_of_2(vocab)
    few = cdiv(rows, max(1, min(16, 4096 // min(v, 2048)))) < 2 * num_sms
    return f"v{v}-{'few' if few else 'many'}"


def bucket_parts(kernel: str, case, gpu: Optional[GPUProfile] = None) -> tuple[str, str]:
    """(length-free class, length part) of a model case (see :func:`shape_bucket`)."""
    gpu = gpu or reference_gpu()
    if isinstance(case, AttnCase):
        s, o = case.shape, case.options
        split = 1
        if kernel == "attention_dkdv":
            from ..core_kernels.flash_attn.plan import AttentionConfig, _dkdv_col_split

            split = _dkdv_col_split(AttentionConfig(), s, o, Target(False, gpu.sms))
        cls = attention_class(max(s.head_dim_qk, s.head_dim_v), s.dtype, attention_kind(o), s.group > 1, split)
        return cls, f"s{length_bucket(max(s.seqlen_q, s.seqlen_k))}"
    if isinstance(case, DecodeCase):
        return decode_class_of(case, gpu), f"L{length_bucket(case.shape.cache.capacity)}"
    if isinstance(case, RowsCase):
        if kernel == "cross_entropy":
            return ce_class(case.rows, case.cols, gpu.sms), ""
        return f"n{next_power_of_2(case.cols)}-{case.dtype}", f"r{length_bucket(case.rows)}"
    raise TypeError(f"case: expected an attention, decode or row-wise case, got {type(case).__name__}")


def shape_bucket(case, kernel: str = "", gpu: Optional[GPUProfile] = None) -> str:
    """The part of a call that decides its best tile: a length-free class (attention: head dim, dtype,
    masking, MHA / GQA, the dK/dV split; decode: the plan's shape class; norms: padded width and dtype;
    cross-entropy: padded vocabulary and few / many rows) and, where lengths matter, a length bucket (powers
    of four from 1K: sequence length, cache capacity, rows). Lookups try the bucket with its length part
    first, then the class alone."""
    cls, length = bucket_parts(kernel, case, gpu)
    return f"{cls}-{length}" if length else cls


def _key(gpu: GPUProfile, version: str, kernel: str, bucket: str) -> str:
    return "|".join((gpu.name, f"sm{gpu.capability}", f"triton {version}", kernel, bucket))


def entry_key(gpu: GPUProfile, kernel: str, case, version: Optional[str] = None) -> str:
    return _key(gpu, version or triton_version(), kernel, shape_bucket(case, kernel, gpu))


def class_key(gpu: GPUProfile, kernel: str, case, version: Optional[str] = None) -> str:
    """:func:`entry_key` without the length part: the entry every length of the class falls back to."""
    return _key(gpu, version or triton_version(), kernel, bucket_parts(kernel, case, gpu)[0])


# ------------------------------------------------------------------------------------------------ reading

def read_entries(path: Path) -> dict[str, Any]:
    """The entries of one cache file; {} when it is missing, and {} with a warning when it is unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"flashbridge tuning cache {path} is unreadable ({e}); using the resource model's choices",
                      stacklevel=2)
        return {}
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


_MEMO: dict[str, tuple] = {}  # path -> (mtime_ns, size, entries, index of versions)
_MEMO_LOCK = threading.Lock()


def _entries(path: Path) -> tuple[dict, dict]:
    """A file's tiles by key, and by (gpu, capability, kernel, bucket) -> {Triton version: tile}; memoised
    per file and re-read when its mtime or size changes (an unreadable file warns once per version of it)."""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    with _MEMO_LOCK:
        memo = _MEMO.get(str(path))
        if memo is not None and memo[0] == stamp:
            return memo[1], memo[2]
    tiles, index = {}, {}
    if stamp is not None:
        for key, entry in read_entries(path).items():
            tile = _tile_of(entry)
            parts = key.split("|")
            if tile is None or len(parts) != 5 or not parts[2].startswith("triton "):
                continue
            tiles[key] = tile
            index.setdefault((parts[0], parts[1], parts[3], parts[4]), {})[parts[2][7:]] = tile
    with _MEMO_LOCK:
        _MEMO[str(path)] = (stamp, tiles, index)
    return tiles, index


def reference_gpu() -> GPUProfile:
    """The GPU a plan target without one resolves as (``Target.gpu`` None: the CPU suite's GPU plans, and
    any target built by hand): the H200, whose shipped entries reproduce the tiles the plans were timed with."""
    from .profiles import PROFILES

    return PROFILES["H200"]


def resolve(kernel: str, cls: str, length: str, gpu: GPUProfile, *, version: Optional[str] = None
            ) -> tuple[Optional[Tile], str]:
    """The cached tile of ``kernel`` for a bucket (``cls`` and its ``length`` part, "" for none) on ``gpu``,
    and where it comes from; (None, "") without an entry. The order:

    1. the user cache (:func:`user_cache_file`): the bucket with its length part, then the class alone;
    2. the shipped entries (:func:`shipped_file`) of this Triton version: the same two keys;
    3. the shipped entries of the same GPU, capability, kernel and bucket under another Triton version (the
       newest first): the same two keys.
    """
    version = version or triton_version()
    buckets = [f"{cls}-{length}", cls] if length else [cls]
    for source, path in (("user cache", user_cache_file()), ("shipped", shipped_file())):
        tiles, _ = _entries(path)
        for b in buckets:
            tile = tiles.get(_key(gpu, version, kernel, b))
            if tile is not None:
                return tile, source
    _, index = _entries(shipped_file())
    for b in buckets:
        versions = index.get((gpu.name, f"sm{gpu.capability}", kernel, b))
        if versions:
            other = max(versions, key=_version_key)
            return versions[other], f"shipped (triton {other})"
    return None, ""


def model_choice(kernel: str, case, gpu: GPUProfile) -> Optional[Tile]:
    """The resource model's choice (no plan default is built: plans call this when nothing is cached)."""
    rep = build_report(MODELS[kernel], case, gpu, with_default=False)
    return rep.choice.tile if rep.choice is not None else None


def lookup(kernel: str, case, gpu: GPUProfile, *, version: Optional[str] = None) -> tuple[Tile, str]:
    """The tile to use for ``kernel`` on ``gpu`` for ``case`` and where it comes from: "user cache",
    "shipped", "shipped (triton X)" (:func:`resolve`'s order), else "model" (the resource model's choice;
    "default", the plan's own, when no candidate survives)."""
    cls, length = bucket_parts(kernel, case, gpu)
    tile, source = resolve(kernel, cls, length, gpu, version=version)
    if tile is not None:
        return tile, source
    tile = model_choice(kernel, case, gpu)
    if tile is not None:
        return tile, "model"
    rep = build_report(MODELS[kernel], case, gpu)
    return rep.default.tile, "default"


_WARNED: set = set()


def plan_tile(kernel: str, target, cls: str, length: str, case: Callable[[], Any], fallback: Tile) -> Tile:
    """What a plan uses for ``kernel`` on a GPU ``target``: :func:`resolve`'s tile, else the resource
    model's choice for ``case()`` (the call as the model sees it), else ``fallback`` -- never an exception.
    Called at plan time only (plans are memoised per call signature)."""
    gpu = target.gpu or reference_gpu()
    tile, _ = resolve(kernel, cls, length, gpu)
    if tile is not None:
        return tile
    try:
        tile = model_choice(kernel, case(), gpu)
    except Exception as e:  # noqa: BLE001 - a shape the model cannot describe: the plan's fallback tile
        if (kernel, cls) not in _WARNED:
            _WARNED.add((kernel, cls))
            warnings.warn(f"flashbridge tiles: no cached tile and no model choice for {kernel} {cls} on "
                          f"{gpu.name} ({e!r}); using {fallback}", stacklevel=2)
        tile = None
    return tile or fallback


def config_for(kernel: str, case, gpu: GPUProfile):
    """The family config (``AttentionConfig``, ``DecodeConfig``, ...) that makes the plan use
    :func:`lookup`'s tile; usable with ``flashbridge.core_kernels.configure``."""
    tile, _ = lookup(kernel, case, gpu)
    return MODELS[kernel].config(tile)


def _tile_of(entry) -> Optional[Tile]:
    try:
        bm, bn, warps, stages = (int(v) for v in entry["tile"])
        return Tile(bm, bn, warps, stages)
    except (TypeError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path``'s side file, held across read-merge-write (fcntl; a no-op where there
    is none: the rename still keeps every reader's view whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a+") as lock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            yield
            return
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def store(entries: dict[str, dict], path: Optional[Path] = None) -> Path:
    """Merge ``entries`` into the cache file (default: the user cache) atomically; returns its path."""
    path = Path(path) if path is not None else user_cache_file()
    with _locked(path):
        merged = read_entries(path)
        merged.update(entries)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(dumps(merged))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def dumps(entries: dict) -> str:
    """A cache file's text: one entry a line, sorted by key (diffs of the shipped file stay readable)."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(entries.items())]
    return '{"schema": %d, "entries": {\n%s\n}}\n' % (SCHEMA, ",\n".join(lines))


def make_entry(tile: Tile, ms: float, **extra) -> dict:
    return {"tile": [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages], "ms": round(ms, 5), **extra}


def case_for(kernel: str, **kw):
    """The model's case object for ``kernel`` from the case function's keyword arguments."""
    make = next(make for kernels, make in OPS.values() if kernel in kernels)
    return make(**kw)
