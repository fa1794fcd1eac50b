"""The one counter-based random generator of the kernels (dropout in the norms and in attention).

``dropout_keep(seed, offsets, p)`` keeps an element when Triton's Philox-4x32-10 uniform (``tl.rand``) of
``(seed, offset)`` is >= p. Counter-based: the mask is a pure function of the seed and each element's
offset, so the backward regenerates it instead of storing it, and torch, JAX, the interpreter and the GPU
all draw the same bits. ``flashbridge.reference.random.philox_uniform`` is the same generator in NumPy (the
float64 references take the exact keep-mask the kernels use from it).
"""
import triton
import triton.language as tl


@triton.jit
def dropout_keep(seed, offs, dropout_p):
    """Bool, the shape of ``offs`` (int64 offsets, any shape): keep the element (seed: an int32 scalar). The
    probability is rounded to float32 first: jax-triton passes Python floats as float64, torch as float32."""
    return tl.rand(seed, offs) >= tl.cast(dropout_p, tl.float32)
