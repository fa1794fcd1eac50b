"""PyTorch front-end: custom ops (torch.library) and nn.Module drop-ins over flashbridge's kernels."""
from .attention import MultiheadAttention, flash_attention, scaled_dot_product_attention
from .cross_entropy import LinearCrossEntropyLoss, cross_entropy, linear_cross_entropy
from .modules import LayerNorm, RMSNorm
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm

__all__ = ["LayerNorm", "LinearCrossEntropyLoss", "MultiheadAttention", "RMSNorm", "cross_entropy",
           "flash_attention", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy", "rms_norm",
           "scaled_dot_product_attention"]
