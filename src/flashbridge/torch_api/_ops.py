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

``torch.func`` transforms (grad, vjp, jacrev, vmap) need more than the dispatcher: the autograd function
``torch.library`` generates for a custom op has no ``setup_context`` staticmethod, which functorch requires,
so under a transform the op runs inside an ``autograd.Function`` of its own (:meth:`FusedOp._transform_function`,
``generate_vmap_rule=True``) made from the same ``setup_context`` / ``backward``. ``vmap`` reaches each op's
batching rule: a rule that folds the vmapped dimension into a batch or row dimension where the op allows it
(:meth:`FusedOp.register_vmap`), else one call per vmapped element.
"""
from __future__ import annotations

import contextvars
import functools
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .._forward_only import no_backward_message
from ..core_kernels._config import _active as _active_configs
from ..core_kernels._config import active_configs, call_configured
from ._runtime import Replay, record_executions, signature

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# True while a transform's backward runs: a vjp function called after its torch.func.vjp returned has
# saved tensors that are functorch wrappers of a finished transform, of type torch.Tensor; only the
# dispatcher unwraps them.
_in_transform_backward: contextvars.ContextVar[bool] = contextvars.ContextVar("in_transform_backward",
                                                                              default=False)


_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def plain_eager(args) -> bool:
    """True when calling the implementation directly is indistinguishable from calling the op: no
    compilation, tracing, dispatch mode or functorch transform, and only plain tensors (not subclasses,
    not functorch wrappers left over from a finished transform)."""
    if (torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active() or torch.jit.is_tracing()
            or _in_transform_backward.get()):
        return False
    return all(type(a) in _PLAIN_TENSORS and not _is_functorch_wrapped(a)
               for a in _tensors(args))


def _tensors(args):
    """The tensors among ``args``, and inside list arguments (``list[Optional[Tensor]]``)."""
    for a in args:
        if isinstance(a, Tensor):
            yield a
        elif type(a) is list:
            yield from (x for x in a if isinstance(x, Tensor))


class _EagerAutograd(torch.autograd.Function):
    """The autograd node of the eager fast path; the FusedOp rides along as the last argument (as
    torch.library's generated autograd function carries its metadata), hidden from ``needs_input_grad``."""

    @staticmethod
    def forward(ctx, *args):
        op, args = args[-1], args[:-1]
        # Gradients of outputs nobody used arrive as None instead of zero tensors (every backward here
        # accepts None): no fill kernels, and e.g. a norm whose h output is unused skips reading its zeros.
        ctx.set_materialize_grads(False)
        result = op.run_eager(args)
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


_apply_eager_autograd = super(torch.autograd.Function, _EagerAutograd).apply


class FusedOp:
    """A custom op ``flashbridge::<name>`` around ``impl``, callable like a function.

    Use as a decorator (:func:`fused_op`), then ``register_fake`` / ``register_autograd`` as with
    ``torch.library.custom_op``. ``FusedOp.eager_fast_path = False`` routes every call through the
    dispatcher (tests compare the two).
    """

    eager_fast_path = True
    replay = True  # False: every eager call runs the implementation (benchmarks compare the two)
    _MAX_REPLAYS = 256  # argument signatures remembered per op

    def __init__(self, name: str, impl: Callable, mutates_args=(), replay: bool = False):
        self.name = name
        self.impl = impl
        # argument signature -> Replay, or None where the call could not be replayed (see run_eager)
        self.replays: Optional[dict] = {} if replay else None
        self.custom_op = torch.library.custom_op(f"flashbridge::{name}", impl, mutates_args=mutates_args)
        self.mutates_args = tuple(mutates_args)
        self.backward: Optional[Callable] = None
        self.setup_context: Optional[Callable] = None
        self.fold: Optional[Callable] = None
        self.custom_op.register_vmap(self._vmap)
        # an op that writes its inputs in place is not differentiable and runs through the dispatcher
        self.transform_function = None if mutates_args else self._transform_function()
        functools.update_wrapper(self, impl)

    def register_fake(self, fake: Callable) -> Callable:
        self.custom_op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        """As ``torch.library``'s, and the backward plans under the configs active when the forward ran
        (``core_kernels._config.call_configured``: a CUDA backward runs on an autograd worker thread, which
        does not see the caller's ``configure`` block)."""

        @functools.wraps(setup_context)
        def setup_with_configs(ctx, inputs, output):
            ctx.flashbridge_configs = active_configs()
            setup_context(ctx, inputs, output)

        @functools.wraps(backward)
        def backward_with_configs(ctx, *grads):
            return call_configured(getattr(ctx, "flashbridge_configs", ()), backward, ctx, *grads)

        self.custom_op.register_autograd(backward_with_configs, setup_context=setup_with_configs)
        self.backward, self.setup_context = backward_with_configs, setup_with_configs

    def register_vmap(self, fold: Callable) -> Callable:
        """A batching rule ``fold(batch_size, in_dims, *args) -> (outputs, out_dims) | None`` that runs the
        op once with the vmapped dimension folded into a batch or row dimension; None where it cannot (e.g.
        a vmapped weight whose gradient sums over rows), and then the op runs once per vmapped element."""
        self.fold = fold
        return fold

    def _vmap(self, info, in_dims, *args):
        # Runs below the vmap level: self.overload reaches the next dispatch key (autograd, then the kernel).
        if self.fold is not None:
            folded = self.fold(info.batch_size, in_dims, *args)
            if folded is not None:
                return folded
        return self._vmap_loop(info.batch_size, in_dims, args)

    def _vmap_loop(self, batch_size: int, in_dims, args):
        """The op once per vmapped element, results stacked along dim 0 (an in-place op writes each
        element's slice of the mutated tensors, which must then be batched themselves)."""
        names = [a.name for a in self.overload._schema.arguments]
        for name in self.mutates_args:
            if in_dims[names.index(name)] is None:
                raise ValueError(f"{name}: under vmap, a tensor that {self.name} writes in place must be "
                                 "vmapped too (each element of the batch writes its own slice)")
        results = [self.overload(*(_select(a, d, i) for a, d in zip(args, in_dims))) for i in range(batch_size)]
        if results[0] is None:
            return None, None
        if isinstance(results[0], Tensor):
            return torch.stack(results), 0
        return tuple(torch.stack(r) for r in zip(*results)), (0,) * len(results[0])

    def _transform_function(self) -> type[torch.autograd.Function]:
        """The op as an ``autograd.Function`` functorch accepts: forward through the dispatcher (so vmap
        reaches the batching rule), then the setup_context and backward given to :meth:`register_autograd`.
        An op without them (a backward, a forward-only op) gets a backward that says so: torch.func.grad
        records every op (it differentiates with ``create_graph=True``), but only a second derivative of a
        flashbridge op would run it."""
        op = self

        def setup_context(ctx, inputs, output):
            # as on the eager path: an output nobody used gets None, not a zero tensor, so the backward
            # runs the same plan (e.g. attention without a dlse input) and gives the same bits
            ctx.set_materialize_grads(False)
            if op.setup_context is not None:
                op.setup_context(ctx, inputs, output)

        def backward(ctx, *grads):
            if op.backward is None:
                raise RuntimeError(f"flashbridge::{op.name} has no derivative (flashbridge's ops are "
                                   "differentiable once: no second derivatives)")
            token = _in_transform_backward.set(True)
            try:
                return op.backward(ctx, *grads)
            finally:
                _in_transform_backward.reset(token)

        return type(f"{self.name}_function", (torch.autograd.Function,), {
            "forward": staticmethod(lambda *args: op.overload(*args)),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "generate_vmap_rule": True,
        })

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.flashbridge.<name>.default``."""
        return getattr(torch.ops.flashbridge, self.name).default

    def __call__(self, *args):
        if not (FusedOp.eager_fast_path and plain_eager(args)):
            if self.transform_function is not None and torch._C._are_functorch_transforms_active():
                return self.transform_function.apply(*args)
            return self.overload(*args)
        if (self.backward is not None and torch.is_grad_enabled()
                and any(isinstance(a, Tensor) and a.requires_grad for a in args)):
            # torch.autograd.Function.apply's Python layer only binds defaults and unwraps functorch
            # wrappers, neither of which a plain eager call has: the C++ apply directly
            return _apply_eager_autograd(*args, self)
        return self.run_eager(args)

    def run_eager(self, args):
        """The implementation on plain tensors. An op declared ``replay=True`` (:func:`fused_op`) runs it
        once per argument signature (addresses modulo 16 included), recording its kernel execution; later
        calls of that signature replay
        the execution (:class:`~._runtime.Replay`): the same kernels, the same bits, without the checks,
        planning and bookkeeping of the implementation on the eager hot path."""
        replays = self.replays
        if replays is None or not FusedOp.replay:
            return self.impl(*args)
        # plans depend on the active configs too; run_eager sees plain tensors only, whose addresses can be read
        key = (_active_configs.get(), signature(args, addresses=True))
        replay = replays.get(key, _UNSEEN)
        if replay is _UNSEEN:
            result, calls = record_executions(self.impl, args)
            if len(replays) >= self._MAX_REPLAYS:
                del replays[next(iter(replays))]
            replays[key] = Replay.of(args, result, calls)
            return result
        return self.impl(*args) if replay is None else replay(args)


_UNSEEN = object()


def _select(a, dim, i: int):
    """Element ``i`` of argument ``a`` along its vmapped dimension ``dim`` (None: not vmapped); a list
    argument has a dimension (or None) per element."""
    if dim is None:
        return a
    if type(a) is list:
        return [x if d is None else x.select(d, i) for x, d in zip(a, dim)]
    return a.select(dim, i)


def register_forward_only(op: FusedOp, name: str) -> None:
    """Give a forward-only op an autograd formula that fails when a gradient reaches it, naming the op
    (without one, torch returns outputs with ``requires_grad=False`` and the gradient is silently lost)."""

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(no_backward_message(name))

    op.register_autograd(backward, setup_context=setup_context)


def vmapped_at(t: Optional[Tensor], dim: Optional[int], batch_size: int, at: int = 0) -> Optional[Tensor]:
    """For batching rules: ``t`` with the vmapped dimension at position ``at`` -- moved there, or
    broadcast there (a view) when ``t`` is not vmapped (``dim`` None). None stays None."""
    if t is None:
        return None
    if dim is None:
        return t.unsqueeze(at).expand(*t.shape[:at], batch_size, *t.shape[at:])
    return t.movedim(dim, at)


def underlying(t: Tensor) -> Tensor:
    """``t`` without torch.func's wrappers: under vmap, the values of every vmapped element at once. Host
    checks of values (a batched tensor has no data of its own) read these, or skip a wrapped tensor."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def fused_op(name: str, *, mutates_args=(), replay: bool = False) -> Callable[[Callable], FusedOp]:
    """Decorator: ``@fused_op("norm_fwd")`` defines ``flashbridge::norm_fwd`` from the function's
    annotations (as ``torch.library.custom_op`` does) and returns its :class:`FusedOp`. ``replay=True``
    declares the implementation a pure function of its argument signature (shapes, strides, dtypes, devices,
    address alignment, other arguments; no reads of tensor values on the GPU path, no state, nothing done to
    the results after the kernels): eager calls then replay its
    kernel execution (:meth:`FusedOp.run_eager`)."""
    return lambda impl: FusedOp(name, impl, mutates_args, replay)
