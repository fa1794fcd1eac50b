"""PyTorch front-end: custom ops (torch.library) and nn.Module drop-ins over flashbridge's kernels."""
from .attention import MultiheadAttention, flash_attention, scaled_dot_product_attention
from .cross_entropy import LinearCrossEntropyLoss, cross_entropy, linear_cross_entropy
from .decode import append_kv_cache, cascade_attention, decode_attention, merge_attention_states
from .modules import LayerNorm, RMSNorm, SwiGLUMLP
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm
from .ring import ring_attention, sequence_shard, sequence_unshard
from .rotary import rotary_embedding, rotary_embedding_qk
from .swiglu import swiglu

__all__ = ["LayerNorm", "LinearCrossEntropyLoss", "MultiheadAttention", "RMSNorm", "append_kv_cache",
           "cascade_attention", "cross_entropy", "decode_attention", "flash_attention", "merge_attention_states", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy", "rms_norm",
           "rotary_embedding", "rotary_embedding_qk", "swiglu", "SwiGLUMLP",
           "scaled_dot_product_attention"]
__all__ += ["ring_attention", "sequence_shard", "sequence_unshard"]
