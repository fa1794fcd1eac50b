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
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Optional

from ..core_kernels._plan import next_power_of_2
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


def triton_version() -> str:
    import triton

    return triton.__version__


def _seq_bucket(n: int) -> str:
    """Lengths grouped by powers of four from 1K: 1k, 4k, 16k, 64k, ..."""
    b = 1024
    while b < n:
        b *= 4
    return f"{b // 1024}k"


def shape_bucket(case) -> str:
    """The part of a call that decides its best tile: head dims, dtype, masking and a coarse length bucket
    (attention); head dims, dtypes, cache kind, GQA group and batch x heads against the SM count (decode);
    padded width, dtype and a row bucket (norms, cross-entropy)."""
    if isinstance(case, AttnCase):
        s, o = case.shape, case.options
        d = max(s.head_dim_qk, s.head_dim_v)
        kind = "causal" if o.causal else "local" if o.has_local else "full"
        return f"d{next_power_of_2(d)}-{s.dtype}-{kind}-g{s.group}-s{_seq_bucket(max(s.seqlen_q, s.seqlen_k))}"
    if isinstance(case, DecodeCase):
        s = case.shape
        c = s.cache
        return (f"d{next_power_of_2(max(s.head_dim_qk, s.head_dim_v))}-{s.dtype}-{c.dtype}-"
                f"{'paged' if c.paged else 'contig'}-g{s.group}-q{s.seqlen_q}-bh{next_power_of_2(s.batch * s.heads_kv)}"
                f"-L{_seq_bucket(c.capacity)}")
    if isinstance(case, RowsCase):
        return f"n{next_power_of_2(case.cols)}-{case.dtype}-r{_seq_bucket(case.rows)}"
    raise TypeError(f"case: expected an attention, decode or row-wise case, got {type(case).__name__}")


def entry_key(gpu: GPUProfile, kernel: str, case, version: Optional[str] = None) -> str:
    return "|".join((gpu.name, f"sm{gpu.capability}", f"triton {version or triton_version()}", kernel,
                     shape_bucket(case)))


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


def lookup(kernel: str, case, gpu: GPUProfile, *, version: Optional[str] = None) -> tuple[Tile, str]:
    """The tile to use for ``kernel`` on ``gpu`` for ``case`` and where it comes from: "user cache",
    "shipped" or "model" (the resource model's choice; the plan's default when no candidate survives)."""
    key = entry_key(gpu, kernel, case, version)
    for source, path in (("user cache", user_cache_file()), ("shipped", shipped_file())):
        entry = read_entries(path).get(key)
        tile = _tile_of(entry)
        if tile is not None:
            return tile, source
    rep = build_report(MODELS[kernel], case, gpu)
    if rep.choice is not None:
        return rep.choice.tile, "model"
    return rep.default.tile, "default"


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
                json.dump({"schema": SCHEMA, "entries": dict(sorted(merged.items()))}, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def make_entry(tile: Tile, ms: float, **extra) -> dict:
    return {"tile": [tile.block_m, tile.block_n, tile.num_warps, tile.num_stages], "ms": round(ms, 5), **extra}


def case_for(kernel: str, **kw):
    """The model's case object for ``kernel`` from the case function's keyword arguments."""
    make = next(make for kernels, make in OPS.values() if kernel in kernels)
    return make(**kw)
