"""Experiment switches: the one way to run the kernels with other tiles or launch settings than the defaults.

Each family keeps its tunable settings in one frozen dataclass whose ``None`` fields mean "the default for
the target" (``AttentionConfig``, ``DecodeConfig``, ``CEConfig``, ``NormConfig``, ``MLAConfig``, ...). A plan
function takes it as ``config=``; with ``config=None`` (the default) it uses the one set by the innermost
:func:`configure` around the call, else the defaults. The public ops take no config: benchmarks and tests that go through
them wrap the call in ``configure(...)``.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import TypeVar

T = TypeVar("T")
_active: contextvars.ContextVar[tuple] = contextvars.ContextVar("flashbridge_configs", default=())


@contextlib.contextmanager
def configure(*configs):
    """Plan with ``configs`` (at most one per family) inside the block, in both front-ends.

    Example (decode with 128-key tiles)::

        with configure(DecodeConfig(block_n=128)):
            out = decode_attention(q, k_cache, v_cache, cache_seqlens=lengths)

    JAX reads the config while it traces: a function jitted before the block keeps the plans it was
    traced with. PyTorch plans a backward under the configs active when its forward ran, with those active
    around the backward on top (see :func:`call_configured`).
    """
    kinds = [type(c) for c in configs]
    for c in configs:
        if not (dataclasses.is_dataclass(c) and type(c).__name__.endswith("Config")):
            raise TypeError(f"configure: expected family config instances (AttentionConfig, DecodeConfig, "
                            f"CEConfig, NormConfig), got {type(c).__name__}")
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"configure: one config per family, got {[k.__name__ for k in kinds]}")
    token = _active.set(tuple(c for c in _active.get() if type(c) not in kinds) + tuple(configs))
    try:
        yield
    finally:
        _active.reset(token)


def active_configs() -> tuple:
    """The configs of the enclosing :func:`configure` blocks, as a snapshot for :func:`call_configured`."""
    return _active.get()


def call_configured(snapshot: tuple, fn, *args):
    """``fn(*args)`` planned under ``snapshot`` (from :func:`active_configs`), with the configs active here on
    top (one per family, as in :func:`configure`).

    Why: torch runs a CUDA graph's backward on an autograd worker thread, where a ``configure`` block around
    the forward and the ``backward()`` call is not visible (a context variable holds a value per thread), so
    the torch ops run their backward under the snapshot their forward took. A plain function, not a context
    manager: the common case (no snapshot, or the same configs) is one comparison on the backward's path."""
    current = _active.get()
    if not snapshot or snapshot == current:
        return fn(*args)
    kinds = {type(c) for c in current}
    token = _active.set(tuple(c for c in snapshot if type(c) not in kinds) + current)
    try:
        return fn(*args)
    finally:
        _active.reset(token)


def active_config(kind: type[T]) -> T:
    """The ``kind`` config set by the innermost :func:`configure`, else ``kind()`` (every default)."""
    for config in _active.get():
        if type(config) is kind:
            return config
    return _default(kind)


@functools.cache
def _default(kind):
    return kind()
