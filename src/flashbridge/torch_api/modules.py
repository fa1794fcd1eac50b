"""nn.Module drop-ins: same constructor arguments and state_dict keys as their torch.nn counterparts."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from .norms import layer_norm, rms_norm
from .swiglu import swiglu


def _as_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


def _flatten_normalized(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    k = len(shape)
    if tuple(x.shape[x.ndim - k:]) != shape:
        raise ValueError(f"x: expected trailing dimensions {shape}, got shape {tuple(x.shape)}")
    return x if k == 1 else x.reshape(*x.shape[:x.ndim - k], math.prod(shape))


class RMSNorm(nn.Module):
    """Drop-in for :class:`torch.nn.RMSNorm` running flashbridge's fused kernel.

    ``forward(x, residual=None)``: with ``residual`` returns ``(y, x + residual)`` from one pass.
    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in torch.nn.RMSNorm.

    Example::

        >>> norm = RMSNorm(64)
        >>> norm.load_state_dict(torch.nn.RMSNorm(64).state_dict())
        <All keys matched successfully>
        >>> norm(torch.randn(2, 8, 64)).shape
        torch.Size([2, 8, 64])
    """

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        shape = x.shape
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        weight = None if self.weight is None else self.weight.reshape(-1)
        xf = _flatten_normalized(x, self.normalized_shape)
        rf = None if residual is None else _flatten_normalized(residual, self.normalized_shape)
        out = rms_norm(xf, weight, eps=eps, residual=rf)
        if residual is None:
            return out.reshape(shape)
        return out[0].reshape(shape), out[1].reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """Drop-in for :class:`torch.nn.LayerNorm` running flashbridge's fused kernel.

    ``forward(x, residual=None)``: with ``residual`` returns ``(y, x + residual)`` from one pass.

    Example::

        >>> norm = LayerNorm(64)
        >>> y, h = norm(torch.randn(4, 64), residual=torch.randn(4, 64))
        >>> y.shape, h.shape
        (torch.Size([4, 64]), torch.Size([4, 64]))
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
        shape = x.shape
        weight = None if self.weight is None else self.weight.reshape(-1)
        bias = None if self.bias is None else self.bias.reshape(-1)
        xf = _flatten_normalized(x, self.normalized_shape)
        rf = None if residual is None else _flatten_normalized(residual, self.normalized_shape)
        out = layer_norm(xf, weight, bias, eps=self.eps, residual=rf)
        if residual is None:
            return out.reshape(shape)
        return out[0].reshape(shape), out[1].reshape(shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class SwiGLUMLP(nn.Module):
    """The gated MLP of Llama-style blocks, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, with flashbridge's
    SwiGLU kernel between the projections: a drop-in for Hugging Face's ``LlamaMLP`` and liger-kernel's
    ``LigerSwiGLUMLP`` (same submodule names, so their state dicts load), or, with ``fused=True``, for
    ``Phi3MLP`` / ``LigerPhi3SwiGLUMLP`` (one ``gate_up_proj`` of width 2 * intermediate_size, gate first:
    one GEMM and :func:`swiglu` of its output).

    Example::

        >>> mlp = SwiGLUMLP(64, 176)
        >>> sorted(mlp.state_dict())
        ['down_proj.weight', 'gate_proj.weight', 'up_proj.weight']
        >>> mlp(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, fused: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.fused = fused
        kw = dict(bias=bias, device=device, dtype=dtype)
        if fused:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_config(cls, config, **kwargs) -> "SwiGLUMLP":
        """From a Hugging Face model config (``hidden_size``, ``intermediate_size``, ``hidden_act`` of "silu"
        or "swish", optional ``mlp_bias``), as ``LlamaMLP(config)`` / ``LigerSwiGLUMLP(config)`` take it."""
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act: SwiGLUMLP computes silu, got {act!r}")
        return cls(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)),
                   **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused:
            return self.down_proj(swiglu(self.gate_up_proj(x)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, fused={self.fused}"
