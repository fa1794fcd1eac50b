"""PyTorch front-end: custom ops (torch.library) and nn.Module drop-ins over flashbridge's kernels."""
from .attention import MultiheadAttention, flash_attention, scaled_dot_product_attention
from .block_sparse import masks_from_flex
from .cross_entropy import LinearCrossEntropyLoss, cross_entropy, linear_cross_entropy
from .decode import append_kv_cache, cascade_attention, decode_attention, merge_attention_states
from .modules import LayerNorm, RMSNorm
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm

__all__ = ["LayerNorm", "LinearCrossEntropyLoss", "MultiheadAttention", "RMSNorm", "append_kv_cache",
           "cascade_attention", "cross_entropy", "decode_attention", "flash_attention", "masks_from_flex", "merge_attention_states", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy", "rms_norm",
           "scaled_dot_product_attention"]
