"""The plans' link to their kernels and the one mechanism for experiment switches (``configure``).

Every Plan checks, when it is built, that each launch matches its kernel's signature: as many tensors as the
kernel's leading pointers, the runtime scalars by name in the kernel's order, then the outputs, and exactly
the kernel's constexprs. Here every plan family is built at a few shapes and options (together they launch
every kernel of core_kernels), and broken launches are refused by name.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import numpy as np
import pytest
from triton.runtime.jit import JITFunction

from flashbridge import core_kernels
from flashbridge.core_kernels import INTERPRETER, Plan, Target, configure
from flashbridge.core_kernels._loader import check_launch_signature
from flashbridge.core_kernels.cross_entropy import plan as C
from flashbridge.core_kernels.decode import plan as D
from flashbridge.core_kernels.flash_attn import plan as A
from flashbridge.core_kernels.mla import plan as M
from flashbridge.core_kernels.norms import plan as N
from flashbridge.core_kernels.rotary import plan as R
from flashbridge.core_kernels.swiglu import plan as G

H200 = Target(interpret=False, num_sms=132)
CE_OPTS = dict(ignore_index=-100, label_smoothing=0.1, z_loss=1e-4, logit_softcap=0.0)


def _attention_plans(target):
    for d, causal, hkv, extra in ((128, False, 4, {}), (64, True, 8, {"sinks": ((8,), "float32")}),
                                  (256, True, 8, {"alibi_slopes": ((2, 8), "float32")}), (96, False, 8, {})):
        info = ((2, 130, 8, d), "bfloat16"), ((2, 257, hkv, d), "bfloat16")
        shape, options = A.check_attention_args(q=info[0], k=info[1], v=info[1], causal=causal, **extra)
        yield A.plan_attention_fwd(shape, options, target=target)
        alibi_grad = "float32" if "alibi_slopes" in extra else None
        yield A.plan_attention_bwd(shape, options, target=target, has_dlse=causal,
                                   sinks_dtype="float32" if "sinks" in extra else None, alibi_grad=alibi_grad)
        yield A.plan_attention_bwd(shape, options, target=target, config=A.AttentionConfig(fused_backward=False),
                                   alibi_grad=alibi_grad)
    shape, options = A.check_attention_args(
        q=((300, 8, 64), "float16"), k=((250, 2, 64), "float16"), v=((250, 2, 64), "float16"),
        cu_seqlens_q=((4,), "int32"), cu_seqlens_k=((4,), "int32"), max_seqlen_q=200, max_seqlen_k=100,
        window_size=(32, 0))
    yield A.plan_attention_fwd(shape, options, target=target)
    yield A.plan_attention_bwd(shape, options, target=target)
    # keys from a cache: paged (block_table) and padded with seqused_k, beside packed queries
    q = ((300, 8, 64), "float16")
    for k, table in ((((40, 16, 2, 64), "float16"), ((3, 8), "int32")), (((3, 256, 2, 64), "float16"), None)):
        shape, options, cache = A.check_kv_cache_args(q=q, k=k, v=k, block_table=table, seqused_k=((3,), "int32"),
                                                      cu_seqlens_q=((4,), "int32"), max_seqlen_q=200, causal=True)
        yield A.plan_attention_fwd(shape, options, target=target, cache=cache)


def _decode_plans(target):
    for cache_dtype, page_size, dqk in (("bfloat16", None, 128), ("float8_e4m3fn", 64, 128),
                                        ("bfloat16", 16, 576)):
        dv = 512 if dqk == 576 else dqk
        shape_k = (64, page_size, 2, dqk) if page_size else (4, 1024, 2, dqk)
        shape_v = shape_k[:3] + (dv,)
        extra = {"block_table": ((4, 16), "int32")} if page_size else {}
        if cache_dtype != "bfloat16":
            extra.update(k_scale=((2,), "float32"), v_scale=((2,), "float32"))
        shape, options, _ = D.check_decode_args(q=((4, 2, 16, dqk), "bfloat16"), k_cache=(shape_k, cache_dtype),
                                                v_cache=(shape_v, cache_dtype), cache_seqlens=((4,), "int32"),
                                                sinks=((16,), "float32"), **extra)
        for splits in (None, 1, 5):
            yield D.plan_decode(shape, options, target=target, num_splits=splits)
        if dqk == 576:
            continue
        cshape, shared_len, coptions, _ = D.check_cascade_args(
            q=((4, 1, 16, dqk), "bfloat16"), shared_k=((300, 2, dqk), cache_dtype),
            shared_v=((300, 2, dv), cache_dtype), k_cache=(shape_k, cache_dtype), v_cache=(shape_v, cache_dtype),
            cache_seqlens=((4,), "int32"), **extra)
        yield D.plan_cascade(cshape, shared_len, coptions, target=target)
        append = D.check_append_args(k_cache=(shape_k, cache_dtype), v_cache=(shape_v, cache_dtype),
                                     k_new=((4, 3, 2, dqk), "bfloat16"), v_new=((4, 3, 2, dv), "bfloat16"),
                                     cache_seqlens=((4,), "int32"), **extra)
        yield D.plan_append(append, target=target)
    yield D.plan_merge(3, 100, 64, "float32", target=target)


def _norm_plans(target):
    for is_rms, dropout in ((True, 0.0), (False, 0.3)):
        yield N.plan_norm_fwd(100, 768, x_dtype="bfloat16", residual_dtype="float32", is_rms=is_rms, has_weight=True,
                              has_bias=not is_rms, has_post_residual=dropout > 0, dropout_p=dropout, eps=1e-5,
                              target=target)
        yield N.plan_norm_bwd(100, 768, dx_dtype="bfloat16", weight_dtype="bfloat16",
                              bias_dtype=None if is_rms else "float32", is_rms=is_rms, has_dh=True, dropout_p=dropout,
                              target=target)


def _cross_entropy_plans(target):
    yield C.plan_ce_fwd(37, 1000, **CE_OPTS, target=target)
    yield C.plan_ce_grad(37, 1000, grad_dtype="float16", per_row_weight=True, **CE_OPTS, target=target)
    yield C.plan_ce_fwd_grad(37, 1000, grad_dtype="bfloat16", per_row_weight=False, **CE_OPTS, target=target)
    yield C.plan_ce_fwd_grad(37, 1000, grad_dtype="bfloat16", per_row_weight=False, **CE_OPTS, target=target,
                             class_weight=True, predicted_dtype="int64")
    yield C.plan_class_weight_sum(1000, target=target)
    for class_weight in (True, False):
        yield C.plan_mean_scales(37, 1000, class_weight=class_weight, ignore_index=-100, target=target)
        yield C.plan_ce_total(37, has_z=class_weight, has_scales=not class_weight, target=target)
    yield C.plan_linear_logits(40, 1000, 64, dtype="bfloat16", weight_transposed=True, has_bias=True,
                               out_shape=(64, 1000), target=target)
    for forward, dw_rows in ((True, True), (False, False)):
        linear = C.plan_linear_cross_entropy(
            130, 32, 1000, dtype="float32", forward=forward, want_dh=True, want_dw=True, want_db=True,
            chunk_size=None, logits_into_dw_rows=dw_rows, per_row_weight=True, **CE_OPTS, target=target)
        for start, stop, _ in linear.chunk_bounds():
            yield linear.chunk_plan(stop - start, target)
        for s in linear.slices:
            yield linear.slice_plan(130, s.c0, s.c1, target)


def _rotary_plans(target):
    for x, k, extra in ((((2, 33, 4, 64), "bfloat16"), None, {}),
                        (((50, 4, 80), "float16"), ((50, 2, 80), "float16"), {"cu_seqlens": ((3,), "int32")})):
        shape = R.check_rotary_args(x=x, k=k, cos=((64, 24), "float32"), sin=((64, 24), "float32"), **extra)
        for interleaved, inplace in ((False, False), (True, True)):
            yield R.plan_rotary(shape, dtype=x[1], interleaved=interleaved, conjugate=inplace, inplace=inplace,
                                target=target)


def _swiglu_plans(target):
    for fused in (False, True):
        yield G.plan_swiglu_fwd(37, 1000, dtype="bfloat16", fused=fused, target=target)
        yield G.plan_swiglu_bwd(37, 1000, dtype="bfloat16", fused=fused, target=target)


def _mla_plans(target):
    q, kv = ((2, 70, 16, 576), "bfloat16"), ((2, 130, 576), "bfloat16")
    for causal, indices in ((True, None), (False, ((2, 70, 40), "int32"))):
        shape, options = M.check_mla_args(q=q, kv=kv, causal=causal, indices=indices)
        yield M.plan_mla_fwd(shape, options, target=target)
        yield M.plan_mla_bwd(shape, options, target=target, has_dlse=causal)
    shape, options, _ = M.check_mla_decode_args(q=((4, 1, 16, 576), "bfloat16"), kv_cache=((40, 64, 576), "bfloat16"),
                                                cache_seqlens=((4,), "int32"), block_table=((4, 10), "int32"))
    for splits in (1, 4):
        yield M.plan_mla_fwd(shape, options, target=target, num_splits=splits)


def _all_plans():
    for target in (H200, INTERPRETER):
        for family in (_attention_plans, _decode_plans, _norm_plans, _cross_entropy_plans, _rotary_plans,
                       _swiglu_plans, _mla_plans):
            yield from family(target)


def _all_kernels() -> set[str]:
    """Every top-level kernel of core_kernels, as "family.module:function"."""
    found = set()
    for family in pkgutil.iter_modules(core_kernels.__path__):
        if not family.ispkg:
            continue
        package = importlib.import_module(f"flashbridge.core_kernels.{family.name}")
        for module in pkgutil.iter_modules(package.__path__):
            mod = importlib.import_module(f"{package.__name__}.{module.name}")
            found |= {f"{family.name}.{module.name}:{name}" for name, obj in vars(mod).items()
                      if isinstance(obj, JITFunction) and name.endswith("_kernel")}
    return found


def test_every_plan_matches_its_kernels():
    """The plans of every family (each checked when built) launch every kernel of core_kernels; the check
    also passes unmemoised on each launch."""
    launched = set()
    for plan in _all_plans():
        for launch in plan.launches:
            check_launch_signature.__wrapped__(launch.kernel, len(launch.inputs), next(zip(*launch.scalars), ()),
                                               len(launch.outputs), next(zip(*launch.constexprs), ()))
            launched.add(launch.kernel)
    assert launched == _all_kernels()


def _rebuilt(plan: Plan, **changes) -> Plan:
    """``plan`` with its first launch changed: built again, so checked again."""
    return dataclasses.replace(plan, launches=(dataclasses.replace(plan.launches[0], **changes),
                                               *plan.launches[1:]))


def test_a_broken_launch_is_refused_by_name():
    shape, options = A.check_attention_args(q=((1, 64, 2, 32), "float32"), k=((1, 64, 2, 32), "float32"),
                                            v=((1, 64, 2, 32), "float32"))
    plan = A.plan_attention_fwd(shape, options, target=INTERPRETER)
    launch = plan.launches[0]
    _rebuilt(plan)  # unchanged: fine
    scalars = list(launch.scalars)
    scalars[1], scalars[2] = scalars[2], scalars[1]
    with pytest.raises(ValueError, match="attn_fwd_kernel: runtime scalar 1 of the launch is 'total_q', the "
                                         "kernel's parameter at that position is 'seqlen_k'"):
        _rebuilt(plan, scalars=tuple(scalars))
    n_in, n_sc, n_out = len(launch.inputs), len(launch.scalars), len(launch.outputs)
    with pytest.raises(ValueError, match=rf"attn_fwd_kernel: the launch passes {n_in} inputs, {n_sc - 1} scalars and "
                                         rf"{n_out} outputs \({n_in + n_sc + n_out - 1} positional arguments\); the "
                                         rf"kernel takes {n_in + n_sc + n_out}"):
        _rebuilt(plan, scalars=launch.scalars[:-1])
    with pytest.raises(ValueError, match=rf"the launch passes {n_in - 1} inputs"):
        _rebuilt(plan, inputs=launch.inputs[:-1])
    without = tuple(c for c in launch.constexprs if c[0] != "HEAD_GROUP")
    with pytest.raises(ValueError, match=r"constexprs do not match the kernel's: missing \['HEAD_GROUP'\], "
                                         r"unknown none"):
        _rebuilt(plan, constexprs=without)
    with pytest.raises(ValueError, match=r"missing none, unknown \['KEY_GROUPS'\]"):
        _rebuilt(plan, constexprs=(*launch.constexprs, ("KEY_GROUPS", 1)))


# ------------------------------------------------------------------------------------------ configure

def test_configure_sets_the_plans_config_for_a_block():
    shape, options = A.check_attention_args(q=((1, 256, 2, 64), "bfloat16"), k=((1, 256, 2, 64), "bfloat16"),
                                            v=((1, 256, 2, 64), "bfloat16"))

    def block_m():
        return A.plan_attention_fwd(shape, options, target=H200).launches[0].constexpr_dict()["BLOCK_M"]

    default = block_m()
    with configure(A.AttentionConfig(block_m=32), N.NormConfig(block_m=2)):
        assert block_m() == 32
        with configure(A.AttentionConfig(block_m=16)):  # the innermost wins
            assert block_m() == 16
        assert block_m() == 32
        explicit = A.plan_attention_fwd(shape, options, target=H200, config=A.AttentionConfig())
        assert explicit.launches[0].constexpr_dict()["BLOCK_M"] == default  # config= wins over configure
    assert block_m() == default
    with pytest.raises(ValueError, match="configure: one config per family"):
        with configure(A.AttentionConfig(), A.AttentionConfig(block_m=16)):
            pass
    with pytest.raises(TypeError, match="configure: expected family config instances"):
        with configure({"block_m": 16}):
            pass


def test_configure_reaches_both_front_ends():
    """Decode through both public ops with 16-key blocks (split boundaries move, so the bits change):
    torch and JAX agree bit for bit with and without it, and differ from each other's defaults."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from flashbridge.jax_api import decode_attention as jax_decode
    from flashbridge.torch_api import decode_attention as torch_decode

    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 300, 2, 32)).astype(np.float32) for _ in range(2))
    lengths = np.array([300, 251], np.int32)

    def both():
        out_t = torch_decode(torch.tensor(q), torch.tensor(k), torch.tensor(v), cache_seqlens=torch.tensor(lengths),
                             num_splits=3).numpy()
        out_j = np.asarray(jax.jit(lambda *a: jax_decode(*a[:3], cache_seqlens=a[3], num_splits=3))(q, k, v, lengths))
        np.testing.assert_array_equal(out_j, out_t)
        return out_t

    default = both()
    with configure(D.DecodeConfig(block_n=16)):
        small = both()
    assert not np.array_equal(small, default)
    np.testing.assert_allclose(small, default, rtol=1e-5, atol=1e-6)
