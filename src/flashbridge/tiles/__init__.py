"""Tiles that explain themselves: a resource model of every kernel's candidate tiles for any GPU.

* :mod:`.profiles`: GPU limits (:data:`PROFILES`, :func:`profile`, :func:`profile_of` for a live device);
* :mod:`.model`: candidate tiles per kernel with shared memory, registers, occupancy and arithmetic
  intensity, a verdict per candidate (kept, or pruned and why) and the model's choice (:func:`report`);
* :mod:`.compiled`: the same figures from the compiler (shared memory, registers, spills) for checking;
* :mod:`.cache`: tuned choices persisted as JSON, keyed by GPU, Triton version, op and shape bucket;
* :mod:`.warmup`: compile the kernels a model will use before its first step.
"""
from __future__ import annotations

from .model import MODELS, OPS, Report, Tile, build_report
from .profiles import PROFILES, GPUProfile, profile, profile_of


def report(kernel: str, gpu="H200", **case) -> Report:
    """The candidate table of ``kernel`` (a key of :data:`MODELS`) on ``gpu`` (a profile name or a
    :class:`GPUProfile`) for the call described by ``case`` (the keyword arguments of the kernel's case
    function, e.g. ``head_dim=128, causal=True`` for attention).

    Example::

        >>> from flashbridge import tiles
        >>> r = tiles.report("attention_fwd", "H200", head_dim=128)
        >>> r.choice.tile
        Tile(block_m=128, block_n=128, num_warps=8, num_stages=3)
    """
    model = MODELS[kernel]
    gpu = profile(gpu) if isinstance(gpu, str) else gpu
    make = next(make for kernels, make in OPS.values() if kernel in kernels)
    return build_report(model, make(**case), gpu)


__all__ = ["GPUProfile", "MODELS", "OPS", "PROFILES", "Report", "Tile", "build_report", "profile", "profile_of",
           "report"]
