"""A test aid shared by both runtimes: while ``poison_buffers()`` is active, every buffer that a kernel must
write (all but zero-initialised ones) starts as NaN (-1 for integers), so an element the kernels forget to
write shows up in the results instead of passing as leftover memory."""
from __future__ import annotations

import contextlib

_active = False


@contextlib.contextmanager
def poison_buffers():
    global _active
    saved, _active = _active, True
    try:
        yield
    finally:
        _active = saved


def poisoning() -> bool:
    return _active
