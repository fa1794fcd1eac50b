"""JAX front-end: custom_vjp / custom_vmap ops and Flax NNX modules over flashbridge's kernels.

The Flax modules (``RMSNorm``, ``LayerNorm``) are imported lazily, so the functional ops need no flax.
"""
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm

_FLAX_MODULES = {"RMSNorm", "LayerNorm"}


def __getattr__(name):
    if name in _FLAX_MODULES:
        from . import flax as _flax_modules
        return getattr(_flax_modules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "layer_norm_dropout_residual", "rms_norm"]
