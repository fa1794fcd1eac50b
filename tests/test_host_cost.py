"""The host path of an eager call (CPU, interpreter): plans prepared once per plan, validation and planning
once per argument signature, and the direct compiled-kernel launch passing exactly what JITFunction.run
passes; in JAX, eager calls through a jit compiled once per configuration, with the bits of the call inside
jax.jit."""
from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashbridge import masks  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402
from flashbridge.core_kernels import get_kernel  # noqa: E402
from flashbridge.core_kernels._loader import BoundLaunch  # noqa: E402
from flashbridge.torch_api import _runtime  # noqa: E402
from helpers import JAX_HOST_FAMILIES, assert_jax_eager_matches_jit, jax_host_cases  # noqa: E402

# the modules (torch_api's namespace binds their public functions under the same names)
attention, block_sparse, cross_entropy, decode, norms = (
    importlib.import_module(f"flashbridge.torch_api.{m}")
    for m in ("attention", "block_sparse", "cross_entropy", "decode", "norms"))


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _calls():
    x, w = _rand(1, 6, 40), _rand(2, 40)
    q, k, v = _rand(3, 1, 9, 2, 16), _rand(4, 1, 11, 2, 16), _rand(5, 1, 11, 2, 16)
    qd, kc = _rand(6, 2, 1, 4, 16), _rand(7, 2, 20, 2, 16)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    logits, labels = _rand(8, 5, 37), torch.tensor([0, 3, 36, -100, 5])
    sparse = masks.causal(9, 11, block_size=16) & masks.from_dense(np.random.default_rng(0).random((9, 11)) < 0.7,
                                                                    block_size=16)
    return {
        "norms": (lambda: ft.rms_norm(x, w), (norms.check_norm_args, norms.plan_norm_fwd)),
        "attention": (lambda: ft.flash_attention(q, k, v, causal=True),
                      (attention.check_attention_args, attention.plan_attention_fwd)),
        "block_sparse": (lambda: ft.flash_attention(q, k, v, block_mask=sparse),
                         (block_sparse.check_attention_args, block_sparse.plan_attention_fwd)),
        "decode": (lambda: ft.decode_attention(qd, kc, kc, cache_seqlens=lens, num_splits=2),
                   (decode.check_decode_args,)),
        "cross_entropy": (lambda: ft.cross_entropy(logits, labels),
                          (cross_entropy.check_cross_entropy_args, cross_entropy.plan_ce_fwd,
                           cross_entropy.plan_mean_scales, cross_entropy.plan_ce_total)),
    }


@pytest.mark.parametrize("family", ["norms", "attention", "block_sparse", "decode", "cross_entropy"])
def test_second_call_with_the_same_signature_skips_validation_and_planning(family):
    call, memoised = _calls()[family]
    first = call()
    misses = [fn.misses for fn in memoised]
    assert all(m > 0 for m in misses)
    second = call()
    assert [fn.misses for fn in memoised] == misses, "validation or planning ran again"
    assert torch.equal(torch.as_tensor(first[0] if isinstance(first, tuple) else first),
                       torch.as_tensor(second[0] if isinstance(second, tuple) else second))


def test_bad_input_still_raises_after_a_cached_good_call():
    x, w = _rand(1, 6, 40), _rand(2, 40)
    ft.rms_norm(x, w)
    for _ in range(2):  # errors are never cached
        with pytest.raises(ValueError, match="weight"):
            ft.rms_norm(x, _rand(3, 41))
    with pytest.raises(ValueError, match="eps"):
        ft.rms_norm(x, w, eps=0.0)


def _plain_execute(plan, inputs):
    """The plan run the plain way: one fresh buffer per Spec, every launch through ``kernel[grid](...)``."""
    env = dict(inputs)
    for spec in plan.buffers:
        dtype = _runtime.TORCH_DTYPES[spec.dtype]
        env[spec.name] = (torch.zeros if spec.zero else torch.empty)(spec.shape, dtype=dtype)
    for launch in plan.launches:
        get_kernel(launch.kernel, True)[launch.grid](
            *[env[n] for n in launch.inputs], *launch.scalar_values(), *[env[n] for n in launch.outputs],
            **launch.constexpr_dict())
    return tuple(env[r] for r in plan.results)


def _plans():
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.norms.plan import plan_norm_bwd

    n_rows, n_cols = 37, 48
    bwd = plan_norm_bwd(n_rows, n_cols, dx_dtype="float32", weight_dtype="float32", bias_dtype="float32",
                        is_rms=False, has_dh=False, dropout_p=0.0, target=INTERPRETER)
    inputs = {"dy": _rand(1, n_rows, n_cols), "h": _rand(2, n_rows, n_cols), "weight": _rand(3, n_cols),
              "mean": _rand(4, n_rows), "rstd": _rand(5, n_rows).abs() + 0.5}
    return [(bwd, inputs)]


def test_prepared_program_matches_plain_launches_bit_for_bit():
    """The runtime's prepared program (scratch carved from one buffer, launches bound once) gives the bits
    of the plain per-buffer, per-launch path, with a scratch buffer between two launches."""
    for plan, inputs in _plans():
        assert any(s.name not in plan.results and not s.zero for s in plan.buffers), "no scratch exercised"
        ours = _runtime.execute(plan, inputs)
        plain = _plain_execute(plan, inputs)
        for a, b in zip(ours, plain):
            assert torch.equal(a, b)
        assert ("torch", True) in plan.runtime_state


def _all_launches():
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.norms.plan import plan_norm_bwd, plan_norm_fwd

    gpu = Target(interpret=False, num_sms=132)
    plans = [plan_norm_fwd(64, 1024, x_dtype="bfloat16", residual_dtype=None, is_rms=True, has_weight=True,
                           has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6, target=gpu),
             plan_norm_bwd(64, 1024, dx_dtype="bfloat16", weight_dtype="bfloat16", bias_dtype=None, is_rms=True,
                           has_dh=False, dropout_p=0.0, target=gpu)]
    for plan in plans:
        yield from plan.launches


def test_direct_launch_passes_the_arguments_of_jitfunction_run():
    """``BoundLaunch`` calls the compiled kernel with (inputs, scalars, outputs, constexprs in the kernel's
    order): the very tuple JITFunction.run's binder produces from the keyword call."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    for launch in _all_launches():
        bound = BoundLaunch(launch)
        assert bound.tail is not None, launch.kernel
        fn = bound.jit_fn
        binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
        tensors_in = [torch.empty(4) for _ in launch.inputs]
        tensors_out = [torch.empty(4) for _ in launch.outputs]
        args = (*tensors_in, *bound.scalars, *tensors_out)
        params, _, _ = binder(*args, **bound.constexprs, **bound.options)
        assert list(params.values()) == [*args, *bound.tail]
        assert list(params) == list(inspect.signature(fn.fn).parameters)


# ------------------------------------------------------------------------------------------------- JAX
# Every public JAX op checks its arguments on the host, then runs its array part through a jax.jit compiled
# once per configuration (jax_api._runtime.jit_op): an eager call must give the bits of the same call inside
# jax.jit, and a repeated eager call must not trace again.



@pytest.mark.parametrize("family", JAX_HOST_FAMILIES)
def test_jax_eager_call_gives_the_bits_of_the_call_inside_jit(family):
    pytest.importorskip("jax")
    assert_jax_eager_matches_jit(*jax_host_cases()[family], name=family)


def test_jax_repeated_eager_call_does_not_trace_again(monkeypatch):
    """The second eager call with the same signature runs the compiled executable (no plan is executed at
    trace level again); a call under another ``configure`` traces anew, so its plans honour the config."""
    jax = pytest.importorskip("jax")
    from flashbridge.core_kernels import configure
    from flashbridge import jax_api as fj
    from flashbridge.core_kernels.norms.plan import NormConfig
    from flashbridge.jax_api import norms as jax_norms

    traced = []
    real = jax_norms.execute
    monkeypatch.setattr(jax_norms, "execute", lambda *a, **kw: traced.append(1) or real(*a, **kw))
    x, w = jax.random.normal(jax.random.key(1), (3, 17)), jax.numpy.ones(17)
    first = fj.rms_norm(x, w, eps=1e-3)
    count = len(traced)
    assert np.array_equal(fj.rms_norm(x, w, eps=1e-3), first)
    assert len(traced) == count, "the eager call traced again"
    with configure(NormConfig(block_m=1)):
        assert np.array_equal(fj.rms_norm(x, w, eps=1e-3), first)
    assert len(traced) > count, "a call under configure reused the plans of another config"
