"""``torch.library`` custom ops with an eager fast path.

Every flashbridge op is a ``torch.library`` custom op (schema, fake kernel, autograd formula): that is
what ``torch.compile`` traces, what ``torch.library.opcheck`` tests and what dispatch modes, functorch
transforms and tensor subclasses see. Calling a custom op from Python in plain eager mode costs tens of
microseconds of host time per call on top of the kernel launch (the dispatcher round trip, the Python
autograd kernel and its schema-driven argument handling), and a norm's kernel on an H200 takes about
130 us: the GPU would wait for the host.

So :class:`FusedOp` runs the *same* implementation, ``setup_context`` and ``backward`` functions directly
when nothing needs the dispatcher: not compiling or tracing, no dispatch mode active, no functorch
transform, only plain tensors. Then it calls the implementation (no input needs a gradient) or one generic
``torch.autograd.Function`` around it, exactly as ``torch.library``'s own autograd kernel does.
``tests/test_torch_dispatch.py`` asserts both paths give the same bits for an op of every family.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args) -> bool:
    """True when calling the implementation directly is indistinguishable from calling the op."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active() or torch.jit.is_tracing()):
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, Tensor))


class _EagerAutograd(torch.autograd.Function):
    """The autograd node of the eager fast path; the FusedOp rides along as the last argument (as
    torch.library's generated autograd function carries its metadata), hidden from ``needs_input_grad``."""

    @staticmethod
    def forward(ctx, *args):
        op, args = args[-1], args[:-1]
        # Gradients of outputs nobody used arrive as None instead of zero tensors (every backward here
        # accepts None): no fill kernels, and e.g. a norm whose h output is unused skips reading its zeros.
        ctx.set_materialize_grads(False)
        result = op.impl(*args)
        op.setup_context(ctx, args, result)
        ctx.fused_op = op
        return result

    @staticmethod
    def backward(ctx, *grads):
        needs_input_grad = ctx.needs_input_grad
        ctx.needs_input_grad = needs_input_grad[:-1]
        try:
            result = ctx.fused_op.backward(ctx, *grads)
        finally:  # a retained graph runs this node again
            ctx.needs_input_grad = needs_input_grad
        return (*result, None) if isinstance(result, tuple) else (result, None)


class FusedOp:
    """A custom op ``flashbridge::<name>`` around ``impl``, callable like a function.

    Use as a decorator (:func:`fused_op`), then ``register_fake`` / ``register_autograd`` as with
    ``torch.library.custom_op``. ``FusedOp.eager_fast_path = False`` routes every call through the
    dispatcher (tests compare the two).
    """

    eager_fast_path = True

    def __init__(self, name: str, impl: Callable, mutates_args=()):
        self.name = name
        self.impl = impl
        self.custom_op = torch.library.custom_op(f"flashbridge::{name}", impl, mutates_args=mutates_args)
        self.backward: Optional[Callable] = None
        self.setup_context: Optional[Callable] = None
        functools.update_wrapper(self, impl)

    def register_fake(self, fake: Callable) -> Callable:
        self.custom_op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self.custom_op.register_autograd(backward, setup_context=setup_context)
        self.backward, self.setup_context = backward, setup_context

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.flashbridge.<name>.default``."""
        return getattr(torch.ops.flashbridge, self.name).default

    def __call__(self, *args):
        if not (FusedOp.eager_fast_path and plain_eager(args)):
            return self.overload(*args)
        if (self.backward is not None and torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            return _EagerAutograd.apply(*args, self)
        return self.impl(*args)


def fused_op(name: str, *, mutates_args=()) -> Callable[[Callable], FusedOp]:
    """Decorator: ``@fused_op("norm_fwd")`` defines ``flashbridge::norm_fwd`` from the function's
    annotations (as ``torch.library.custom_op`` does) and returns its :class:`FusedOp`."""
    return lambda impl: FusedOp(name, impl, mutates_args)
