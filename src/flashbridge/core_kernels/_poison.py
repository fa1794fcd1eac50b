"""A test aid shared by both runtimes: while ``poison_buffers()`` is active, every buffer that a kernel must
write (all but zero-initialised ones) starts as NaN (-1 for integers), so an element the kernels forget to
write shows up in the results instead of passing as leftover memory. ``poison_buffers(value)`` starts float
buffers at another value instead: a test that expects the kernels themselves to write NaN somewhere."""
from __future__ import annotations

import contextlib

_active = False
_value = float("nan")


@contextlib.contextmanager
def poison_buffers(value: float = float("nan")):
    global _active, _value
    saved = _active, _value
    _active, _value = True, value
    try:
        yield
    finally:
        _active, _value = saved


def poisoning() -> bool:
    return _active


def poison_value() -> float:
    """The value float buffers start at while poisoning."""
    return _value
