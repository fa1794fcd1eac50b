"""JAX front-end: custom_vjp / custom_vmap ops and Flax NNX modules over flashbridge's kernels.

Needs JAX, and on a GPU jax-triton: ``pip install "flashbridge[jax]"`` (which also installs flax). The
Flax modules (``RMSNorm``, ``LayerNorm``, ``MultiHeadAttention``, ``MultiHeadLatentAttention``,
``SwiGLUMLP``) are imported lazily, so the functional ops need no flax.
"""
from .._extras import require

require("jax", "jax", "flashbridge.jax_api")

from . import checks  # noqa: E402,F401  (checkify checks of index arrays under jit)
from .attention import dot_product_attention, flash_attention  # noqa: E402
from .block_sparse import mask_to_device  # noqa: E402
from .cross_entropy import cross_entropy, linear_cross_entropy, linear_cross_entropy_from_layer  # noqa: E402
from .decode import append_kv_cache, cascade_attention, decode_attention, merge_attention_states  # noqa: E402
from .mla import mla_attention, mla_decode  # noqa: E402
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm  # noqa: E402
from .ring import ring_attention, sequence_shard, sequence_unshard  # noqa: E402
from .rotary import rotary_embedding, rotary_embedding_qk  # noqa: E402
from .swiglu import swiglu  # noqa: E402

_FLAX_MODULES = {"RMSNorm": ".flax", "LayerNorm": ".flax", "MultiHeadAttention": ".attention_flax",
                 "MultiHeadLatentAttention": ".mla_flax", "SwiGLUMLP": ".flax"}


def __getattr__(name: str):
    if name in _FLAX_MODULES:
        import importlib
        require("flax", "jax", f"flashbridge.jax_api.{name}")
        return getattr(importlib.import_module(_FLAX_MODULES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LayerNorm", "MultiHeadAttention", "MultiHeadLatentAttention", "RMSNorm", "SwiGLUMLP",
           "append_kv_cache", "cascade_attention", "cross_entropy", "decode_attention", "dot_product_attention",
           "flash_attention", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy",
           "linear_cross_entropy_from_layer", "mask_to_device", "merge_attention_states", "mla_attention", "mla_decode",
           "ring_attention", "rms_norm", "rotary_embedding", "rotary_embedding_qk", "sequence_shard", "sequence_unshard", "swiglu"]
