"""Argument checks shared by the torch front-end's ops (shape / dtype rules live in the plans)."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._runtime import DTYPE_NAMES, signature


def once_per_signature(check):
    """``check(*args)`` (returns nothing, raises on bad arguments) run once per argument signature
    (:func:`~._runtime.signature`). A later call with a signature that passed returns at once; one that
    raised raises again. Runs every time under ``torch.compile`` (dynamo traces it; the compiled graph runs
    no checks), under torch.func transforms (their wrapped tensors have no strides) or with an unhashable
    argument."""
    passed: set = set()

    @functools.wraps(check)
    def wrapper(*args):
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return check(*args)
        try:
            key = signature(args)
            seen = key in passed
        except TypeError:  # an unhashable argument
            return check(*args)
        if not seen:
            check(*args)
            if len(passed) >= 4096:
                passed.clear()
            passed.add(key)

    return wrapper


def check_tensors(tensors: dict[str, Tensor | None], required: tuple[str, ...] = ()) -> torch.device:
    """Every argument a torch.Tensor (or None, unless it is ``required``) of a supported dtype, all on one
    CUDA device or all on the CPU; returns that device."""
    device, first = None, None
    for name, t in tensors.items():
        if t is None:
            if name in required:
                raise TypeError(f"{name}: expected a torch.Tensor, got None")
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor{'' if name in required else ' or None'}, "
                            f"got {type(t).__name__}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported by flashbridge")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name}: tensors must be on a CUDA device or the CPU, got {t.device}")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: on {t.device}, but {first} is on {device}; all tensors of one call "
                             "must be on the same device")
    return device


def check_seed(seed) -> None:
    """A dropout seed: a Python int in int32's range or a one-element int32 / int64 tensor (checked even when
    dropout is off, so that a wrong seed never waits for the first call that uses it)."""
    if isinstance(seed, Tensor):
        if seed.numel() != 1 or seed.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"seed: expected a Python int or a one-element integer tensor, got "
                            f"{seed.dtype} of shape {tuple(seed.shape)}")
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected a Python int or a one-element integer tensor, got {type(seed).__name__}")
    if not -2**31 <= seed < 2**31:
        raise ValueError(f"seed: must fit in int32, got {seed}")


SEED_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 (the 64-bit golden ratio) as an int64


def fold_seed(seed: Tensor) -> Tensor:
    """An int64 seed tensor as the int32 the kernels read, without reading its value (no device sync): values
    inside int32's range stay as they are; others get their high word mixed into the low one (an int64 seed
    of 2**40 used to become seed 0). The same arithmetic as the JAX front-end's."""
    lo = seed.to(torch.int32)  # the low word
    extra = (seed >> 32) - (lo >> 31).to(torch.int64)  # 0 exactly when the value fits in int32
    mix = extra * SEED_MIX
    mix = ((mix ^ (mix >> 32)) & 0xFFFFFFFF) | 1  # odd, so never 0 where extra is not
    return lo ^ torch.where(extra == 0, 0, mix).to(torch.int32)


def seed_tensor(seed: int | Tensor, device: torch.device) -> Tensor:
    """A dropout seed as the int32 ``(1,)`` tensor the kernels read (int64 tensors: :func:`fold_seed`). An int
    is written by a fill on the device: ``torch.tensor([seed], device=...)`` would copy it from pageable host
    memory, which waits for the GPU's stream on every call."""
    check_seed(seed)
    if isinstance(seed, Tensor):
        seed = seed.reshape(1).to(device=device)
        return seed if seed.dtype == torch.int32 else fold_seed(seed)
    return torch.full((1,), seed, dtype=torch.int32, device=device)
