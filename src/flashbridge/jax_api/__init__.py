"""JAX front-end: custom_vjp / custom_vmap ops and Flax NNX modules over flashbridge's kernels."""
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm

__all__ = ["layer_norm", "layer_norm_dropout_residual", "rms_norm"]
