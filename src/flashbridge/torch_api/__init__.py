"""PyTorch front-end: custom ops (torch.library) and nn.Module drop-ins over flashbridge's kernels."""
from .norms import layer_norm, layer_norm_dropout_residual, rms_norm
from .modules import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "layer_norm_dropout_residual", "rms_norm"]
