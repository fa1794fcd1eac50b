"""PyTorch front-end: custom ops (torch.library) and nn.Module drop-ins over flashbridge's kernels.

Needs PyTorch: ``pip install "flashbridge[torch]"``.
"""
from .._extras import require

require("torch", "torch", "flashbridge.torch_api")

from .attention import MultiheadAttention, flash_attention, scaled_dot_product_attention  # noqa: E402
from .block_sparse import masks_from_flex  # noqa: E402
from .cross_entropy import LinearCrossEntropyLoss, cross_entropy, linear_cross_entropy  # noqa: E402
from .decode import append_kv_cache, cascade_attention, decode_attention, merge_attention_states  # noqa: E402
from .mla import MultiHeadLatentAttention, mla_attention, mla_decode  # noqa: E402
from .modules import LayerNorm, RMSNorm, SwiGLUMLP  # noqa: E402
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm  # noqa: E402
from .ring import ring_attention, sequence_shard, sequence_unshard  # noqa: E402
from .rotary import rotary_embedding, rotary_embedding_qk  # noqa: E402
from .swiglu import swiglu  # noqa: E402

__all__ = ["LayerNorm", "LinearCrossEntropyLoss", "MultiHeadLatentAttention", "MultiheadAttention", "RMSNorm",
           "SwiGLUMLP", "append_kv_cache", "cascade_attention", "cross_entropy", "decode_attention",
           "flash_attention", "layer_norm", "layer_norm_dropout_residual", "linear_cross_entropy",
           "masks_from_flex", "merge_attention_states", "mla_attention", "mla_decode", "ring_attention", "rms_norm", "rotary_embedding",
           "rotary_embedding_qk", "sequence_shard", "sequence_unshard", "scaled_dot_product_attention", "swiglu"]
