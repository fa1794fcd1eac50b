"""JAX front-end: custom_vjp / custom_vmap ops and Flax NNX modules over flashbridge's kernels.

The Flax modules (``RMSNorm``, ``LayerNorm``, ``MultiHeadAttention``) are imported lazily, so the functional
ops need no flax.
"""
from .attention import dot_product_attention, flash_attention
from .block_sparse import mask_to_device
from .cross_entropy import cross_entropy, linear_cross_entropy, linear_cross_entropy_from_layer
from .decode import append_kv_cache, cascade_attention, decode_attention, merge_attention_states
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm

_FLAX_MODULES = {"RMSNorm": ".flax", "LayerNorm": ".flax", "MultiHeadAttention": ".attention_flax"}


def __getattr__(name):
    if name in _FLAX_MODULES:
        import importlib
        return getattr(importlib.import_module(_FLAX_MODULES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LayerNorm", "MultiHeadAttention", "RMSNorm", "append_kv_cache", "cascade_attention",
           "cross_entropy", "decode_attention", "dot_product_attention", "flash_attention",
           "mask_to_device", "merge_attention_states", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy",
           "linear_cross_entropy_from_layer", "rms_norm"]
