"""nn.Module drop-ins: same constructor arguments and state_dict keys as their torch.nn counterparts."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
from torch import Tensor, nn

from .norms import layer_norm, rms_norm


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
