"""Both front-ends compile the same kernels: checked on a CPU by compiling for sm_90 (no GPU needed).

torch launches through Triton's own launcher, JAX through jax-triton's ``triton_call``; the two specialise
arguments differently (the launcher marks integers divisible by 16, jax-triton does not), and any difference
in the compiled code is a difference in speed and, potentially, in the bits of the results. Here each plan's
launch is compiled twice for ``GPUTarget("cuda", 90, 32)``:

* as Triton's launcher would: the kernel's own binder specialises the arguments (``JITFunction.run``);
* as jax-triton 0.3.1 would (``get_or_create_triton_kernel``): signature from the positional arguments then
  the outputs, arrays assumed 16-byte aligned, runtime scalars unspecialised except integers equal to 1,
  which become constants, ``ast_to_ttir`` then the backend's stages;

and the two PTX texts must be identical (``helpers.assert_same_ptx``). jax_triton itself is not imported: it
refuses to import without a GPU build of jaxlib. Skips cleanly where Triton has no NVIDIA backend or its ptxas cannot run.

Also here: interpreted launches (the CPU path) leave ``triton.language`` exactly as they found it; before the
fix in ``core_kernels/_loader.py`` they left interpreter versions of its builtins behind, after which every
compile in the process failed (the "JAX dropout kernel does not compile" report).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from flashbridge.core_kernels import HostArray, INTERPRETER, Target, get_kernel
from flashbridge.core_kernels._loader import _language_namespaces
from flashbridge.core_kernels._plan import pow2_divisor
from flashbridge.core_kernels.flash_attn.plan import AttnOptions, AttnShape, plan_attention_bwd, plan_attention_fwd
from flashbridge.core_kernels.cross_entropy.plan import (plan_ce_fwd_grad, plan_ce_total, plan_class_weight_sum,
                                                         plan_linear_logits, plan_mean_scales)
from flashbridge.core_kernels.norms.plan import plan_norm_bwd, plan_norm_fwd
from flashbridge.core_kernels.rotary.plan import check_rotary_args, plan_rotary
from flashbridge.core_kernels.swiglu.plan import plan_swiglu_bwd, plan_swiglu_fwd
from helpers import assert_same_ptx, assert_wgmma_pipelined, compile_as_jax_triton, vector_loads

H200 = Target(interpret=False, num_sms=132)


# ------------------------------------------------------------------------------------------------ plans

_NORM_DTYPES = {**{n: "float32" for n in ("x", "weight", "bias", "residual", "post_residual", "y", "h",
                                          "mean", "rstd", "dy", "dh", "dx", "dw_part", "db_part",
                                          "dweight", "dbias")}, "seed": "int32"}


def _attn_dtypes(dtype: str) -> dict:
    d = {n: dtype for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    d.update({n: "float32" for n in ("lse", "lse2", "delta", "alibi_slopes", "sinks", "dlse", "dsinks",
                                     "dsinks_part", "dalibi_blocks", "dalibi", "dalibi_part")})
    return {**d, "cu_seqlens_q": "int32", "cu_seqlens_k": "int32", "seed": "int32"}


def _attn_case(causal: bool, varlen: bool = False):
    if varlen:
        shape = AttnShape(5, 2048, 2048, 3579, 3166, 16, 4, 128, 128, "bfloat16", True)
    else:
        shape = AttnShape(4, 4096, 4096, 16384, 16384, 16, 16, 128, 128, "bfloat16", False)
    options = AttnOptions(softmax_scale=128 ** -0.5, causal=causal, window_left=None,
                          window_right=0 if causal else None, softcap=0.0, has_alibi=False,
                          alibi_batched=False, has_sinks=False)
    return shape, options


@pytest.mark.parametrize("n_rows,n_cols,dropout_p", [(4096, 2048, 0.0), (1000, 1, 0.0), (512, 768, 0.2)])
def test_norm_kernels_compile_identically(n_rows, n_cols, dropout_p):
    fwd = plan_norm_fwd(n_rows, n_cols, x_dtype="float32", residual_dtype=None, is_rms=False, has_weight=True,
                        has_bias=True, has_post_residual=dropout_p > 0, dropout_p=dropout_p, eps=1e-5,
                        target=H200)
    bwd = plan_norm_bwd(n_rows, n_cols, dx_dtype="float32", weight_dtype="float32", bias_dtype=None,
                        is_rms=False, has_dh=False, dropout_p=dropout_p, target=H200)
    for launch in (fwd.launches[0], bwd.launches[0]):
        assert_same_ptx(launch, _NORM_DTYPES)


@pytest.mark.parametrize("n_rows,vocab", [(8192, 128256), (7, 1000)])
def test_cross_entropy_kernels_compile_identically(n_rows, vocab):
    plan = plan_ce_fwd_grad(n_rows, vocab, grad_dtype="bfloat16", per_row_weight=False, ignore_index=-100,
                            label_smoothing=0.1, z_loss=1e-4, logit_softcap=0.0, target=H200)
    dtypes = {"logits": "bfloat16", "labels": "int32", "weight": "float32", "loss": "float32",
              "lse": "float32", "lse_lo": "float32", "grad": "bfloat16"}
    for launch in plan.launches:
        assert_same_ptx(launch, dtypes)


@pytest.mark.parametrize("smoothing,predicted", [(0.1, "int32"), (0.0, None)])
def test_cross_entropy_weighted_kernels_compile_identically(smoothing, predicted):
    """The class-weighted forward (with the argmax) and gradient kernels, the weight sum's, the mean
    scales' (with and without class weights; IEEE division: ``div.rn.f32``, not ``div.full``) and the
    reduction's. With label
    smoothing the gradient reads the class weights of each tile (from column col0 of a slice: the plan
    states its divisibility) in 16-byte vectors, as the logits: 8 such loads, not 4."""
    plan = plan_ce_fwd_grad(8192, 128256, grad_dtype="bfloat16", per_row_weight=False, ignore_index=-100,
                            label_smoothing=smoothing, z_loss=1e-4, logit_softcap=0.0, target=H200,
                            class_weight=True, predicted_dtype=predicted)
    dtypes = {"logits": "bfloat16", "labels": "int32", "weight": "float32", "z_weight": "float32",
              "class_weight": "float32", "weight_sum": "float32", "loss": "float32", "lse": "float32",
              "lse_lo": "float32", "zloss": "float32", "predicted": "int32", "grad": "bfloat16", "sum": "float32",
              "scales": "float32", "total": "float32"}
    sums = (plan_class_weight_sum(128256, target=H200),
            *(plan_mean_scales(8192, 128256, class_weight=cw, ignore_index=-100, target=H200) for cw in (True, False)),
            plan_ce_total(8192, has_z=True, has_scales=True, target=H200))
    for launch in (*plan.launches, *(launch for p in sums for launch in p.launches)):
        ptx = assert_same_ptx(launch, dtypes)
        if launch.kernel.endswith("ce_grad_weighted_kernel") and smoothing:
            assert vector_loads(ptx) >= 8, "the class weights' loads in the gradient are not 16 bytes wide"
        if "scales" in launch.outputs:  # the reciprocals IEEE-rounded: the bits torch's division would give
            # (without class weights both divisors are the count: one division)
            assert ptx.count("div.rn.f32") == 1 + launch.constexpr_dict()["HAS_CLASS_WEIGHT"]
            assert "div.full" not in ptx and "div.approx" not in ptx


@pytest.mark.parametrize("transposed", [False, True])
def test_linear_logits_kernel_compiles_identically_and_vectorised(transposed):
    """The JAX linear op's logits GEMM (N=4096 tokens, H=4096, V=128256, bf16): the same PTX from both
    launchers, 16-byte asynchronous copies into shared memory and wgmma."""
    plan = plan_linear_logits(4096, 128256, 4096, dtype="bfloat16", weight_transposed=transposed, has_bias=True,
                              out_shape=(128256, 4096), target=H200)
    dtypes = {n: "bfloat16" for n in ("hidden", "weight", "bias", "buffer", "out")}
    ptx = assert_same_ptx(plan.launches[0], dtypes)
    assert "cp.async.cg.shared.global" in ptx and "wgmma.mma_async" in ptx
    assert_wgmma_pipelined(ptx, "linear logits GEMM")


def _prefill_plans(page_size: int):
    """The paged prefill of bench_paged_prefill.py (B=8, 3584 cached + 512 new tokens, Hq=32, Hkv=8, D=128,
    causal, bf16) and the same keys packed contiguously."""
    from flashbridge.core_kernels.flash_attn.plan import check_attention_args, check_kv_cache_args

    batch, chunk, used, hq, hkv, d = 8, 512, 4096, 32, 8, 128
    q = ((batch * chunk, hq, d), "bfloat16")
    cu, table_rows = ((batch + 1,), "int32"), -(-used // page_size)
    shape, opts = check_attention_args(q=q, k=((batch * used, hkv, d), "bfloat16"), v=((batch * used, hkv, d), "bfloat16"),
                                       cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=chunk, max_seqlen_k=used,
                                       causal=True)
    contiguous = plan_attention_fwd(shape, opts, target=H200)
    pool = ((batch * table_rows + 16, page_size, hkv, d), "bfloat16")
    shape, opts, cache = check_kv_cache_args(q=q, k=pool, v=pool, block_table=((batch, table_rows), "int32"),
                                             seqused_k=((batch,), "int32"), cu_seqlens_q=cu, max_seqlen_q=chunk,
                                             causal=True)
    return contiguous, plan_attention_fwd(shape, opts, target=H200, cache=cache)


@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_prefill_stages_kv_as_deep_as_contiguous(page_size):
    """The paged forward reads each key block's table entries one iteration ahead (loop state), so Triton's
    pipeliner stages the K / V gathers as deep as the contiguous loads: the shared memory of Q and three
    128 x 128 K + V stages, 229376 B, as the contiguous kernel (plus the few bytes of the gather that spreads
    a block's pages over its keys, pages of 16 and 64; with the entries read in the iteration that used
    them, two stages, 164352 B); local memory within 32 B a thread of the contiguous kernel's (which spills
    at three stages too); the same PTX from both launchers; wgmma not serialised."""
    from flashbridge.tiles import compiled

    why = compiled.available(90)
    if why:
        pytest.skip(why)
    contiguous, paged = (p.launches[0] for p in _prefill_plans(page_size))
    dtypes = {**_attn_dtypes("bfloat16"), "block_table": "int32", "seqused_k": "int32"}
    want, got = compiled.compile_launch(contiguous, dtypes), compiled.compile_launch(paged, dtypes)
    assert paged.num_stages == contiguous.num_stages == 3
    assert want.shared == 229376 and 0 <= got.shared - want.shared <= 64, (got, want)
    assert got.n_spills <= want.n_spills + 8, (got, want)  # 4-byte words
    ptx = assert_same_ptx(paged, dtypes)
    assert_wgmma_pipelined(ptx, f"paged prefill forward, pages of {page_size}")


_SPARSE_MASKS = ["streaming", "document", "bigbird", "per-head GQA"]


def _block_sparse_case(mask_name: str):
    """(shape, options, layout, dtypes) of block-sparse attention at S=4096, H=16 (4 KV heads for the per-head
    mask), D=128, bf16, with one of the masks of bench_block_sparse.py's kinds; skips where sm_90 cannot be
    compiled for."""
    from flashbridge import masks
    from flashbridge.core_kernels.block_sparse.plan import BWD_ARRAYS, layout_of
    from flashbridge.core_kernels.flash_attn.plan import check_attention_args
    from flashbridge.tiles import compiled

    why = compiled.available(90)
    if why:
        pytest.skip(why)
    seq_len = 4096
    if mask_name == "streaming":
        mask = masks.streaming(seq_len, 4, 1024)
    elif mask_name == "document":
        cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, seq_len), 15, replace=False))
        mask = masks.document(np.diff([0, *cuts, seq_len]).tolist())
    elif mask_name == "bigbird":
        mask = masks.bigbird(seq_len, window_blocks=1, num_global_blocks=2, num_random_blocks=6, seed=0)
    else:
        per_head = np.random.default_rng(0).random((16, seq_len // 128, seq_len // 128)) < 0.2
        mask = masks.from_blocks(per_head, seq_len_q=seq_len, seq_len_k=seq_len)
    heads_kv = 4 if mask_name == "per-head GQA" else 16
    q, kv = ((1, seq_len, 16, 128), "bfloat16"), ((1, seq_len, heads_kv, 128), "bfloat16")
    shape, options = check_attention_args(q=q, k=kv, v=kv)
    return shape, options, layout_of(mask), {**_attn_dtypes("bfloat16"), **{n: "int32" for n in BWD_ARRAYS}}


@pytest.mark.parametrize("mask_name", _SPARSE_MASKS)
def test_block_sparse_forward_stages_kv_as_deep_as_dense(mask_name):
    """The forward's list walk reads the next entry one iteration ahead (fwd_kv_list), so its K / V tiles
    are staged three deep as in the dense kernel (sm_90, D=128), except under document ids, whose walk reads
    each entry in its own step (the deeper full-block loop spilled and ran slower): two stages there."""
    from helpers import staged_buffers

    shape, options, layout, dtypes = _block_sparse_case(mask_name)
    launch = plan_attention_fwd(shape, options, target=H200, sparse=layout).launches[0]
    tiles = [b for b in staged_buffers(launch, dtypes) if len(b) == 3 and b[2] == 128]
    depth = 2 if mask_name == "document" else 3
    assert tiles and all(b[0] == depth for b in tiles if b[1] == 128), tiles
    assert_wgmma_pipelined(assert_same_ptx(launch, dtypes), f"block-sparse forward, {mask_name}")


@pytest.mark.parametrize("mask_name", _SPARSE_MASKS)
def test_block_sparse_backward_stages_as_deep_as_dense(mask_name):
    """The backward's list walks read the next list entry one iteration ahead (loop state), so no tile's
    address waits on a load of its own iteration and Triton's pipeliner stages the q / dO tiles (dK / dV
    walk) and K / V tiles (dQ walk) as deep as the dense kernel's: every 16-bit tile buffer of the one-launch
    backward has three stages (sm_90, D=128), local memory at most 112 B a thread (with the entries read in
    the step that used them: two stages and 136-168 B), the same PTX from both launchers and wgmma not
    serialised."""
    from flashbridge.tiles import compiled
    from helpers import staged_buffers

    shape, options, layout, dtypes = _block_sparse_case(mask_name)
    plan = plan_attention_bwd(shape, options, target=H200, sparse=layout)
    sparse = next(launch for launch in plan.launches if launch.kernel.endswith("attn_bwd_kernel"))
    tiles = [b for b in staged_buffers(sparse, dtypes) if len(b) == 3 and b[1:] == (64, 128)]
    assert tiles and all(b[0] == 3 for b in tiles), tiles
    assert compiled.compile_launch(sparse, dtypes).n_spills * 4 <= 112
    assert_wgmma_pipelined(assert_same_ptx(sparse, dtypes), f"block-sparse backward, {mask_name}")


@pytest.mark.parametrize("masked_num_stages,masked_block_n", [(None, None), (1, None), (None, 64)])
def test_attention_forward_compiles_identically_and_vectorised(masked_num_stages, masked_block_n):
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    shape, options = _attn_case(causal=True)
    plan = plan_attention_fwd(shape, options, target=H200,
                              config=AttentionConfig(masked_num_stages=masked_num_stages,
                                                     masked_block_n=masked_block_n))
    assert plan.launches[0].constexpr_dict()["MASKED_STAGES"] == (masked_num_stages or 0)
    ptx = assert_same_ptx(plan.launches[0], _attn_dtypes("bfloat16"))
    if masked_num_stages != 1:  # depth 1 serialises (sm_90, Triton 3.6 and 3.9): why it measured slower
        assert_wgmma_pipelined(ptx, "attention forward")
    # The loads of q, k and v are 16 bytes wide (and k, v go through cp.async) in both front-ends: the
    # 2.4x slower JAX attention of the H200 had 2-byte loads only.
    assert vector_loads(ptx) > 0, "no 16-byte loads in the attention forward"


def test_attention_backward_compiles_identically_and_vectorised():
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    shape, options = _attn_case(causal=False, varlen=True)
    launches = plan_attention_bwd(shape, options, target=H200, config=AttentionConfig(fused_backward=False)).launches
    ptx = assert_same_ptx(next(l for l in launches if l.kernel.endswith("attn_bwd_dq_kernel")),
                           _attn_dtypes("bfloat16"))
    assert vector_loads(ptx) > 0, "no 16-byte loads in the attention dq kernel"


def test_attention_fused_backward_compiles_identically_and_vectorised():
    """The one-launch backward (dK/dV and dQ grids in one kernel): the same PTX from both launchers, with
    16-byte loads (its 1-D grid decodes the two grids' ids at run time)."""
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    shape, options = _attn_case(causal=True)
    launches = plan_attention_bwd(shape, options, target=H200, config=AttentionConfig(fused_backward=True)).launches
    ptx = assert_same_ptx(next(l for l in launches if l.kernel.endswith(":attn_bwd_kernel")),
                           _attn_dtypes("bfloat16"))
    assert vector_loads(ptx) > 0, "no 16-byte loads in the one-launch attention backward"
    assert_wgmma_pipelined(ptx, "one-launch attention backward")


# the forward and the dQ kernel in the default run; the larger dK/dV compiles (the one-launch backward's
# pipelined MMAs with dropout, the two-kernel dK/dV) in the slow one
@pytest.mark.parametrize("kernel", ["attn_fwd_kernel", pytest.param(":attn_bwd_kernel", marks=pytest.mark.slow),
                                    pytest.param("attn_bwd_dkdv_kernel", marks=pytest.mark.slow),
                                    "attn_bwd_dq_kernel"])
def test_attention_dropout_compiles_identically(kernel):
    """Attention dropout (HAS_DROPOUT: the Philox mask in the forward's P @ V and the backward's dV / dP): the
    same PTX from both launchers (the probability is a float32 scalar in both), MMAs still pipelined."""
    import dataclasses

    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    shape, options = _attn_case(causal=True)
    options = dataclasses.replace(options, dropout_p=0.1)
    if kernel == "attn_fwd_kernel":
        launches = plan_attention_fwd(shape, options, target=H200).launches
    else:
        config = AttentionConfig(fused_backward=kernel == ":attn_bwd_kernel")
        launches = plan_attention_bwd(shape, options, target=H200, config=config).launches
    launch = next(l for l in launches if l.kernel.endswith(kernel))
    assert launch.constexpr_dict()["HAS_DROPOUT"] and "seed" in launch.inputs
    ptx = assert_same_ptx(launch, _attn_dtypes("bfloat16"))
    if kernel in ("attn_fwd_kernel", ":attn_bwd_kernel"):
        assert_wgmma_pipelined(ptx, f"{kernel} with dropout")


def test_attention_backward_with_the_slopes_gradient_compiles_identically():
    """ALiBi with the slopes' gradient (ALIBI_GRAD: the dQ programs' extra reduction, then the per-head sum):
    the same PTX from both launchers, and the one-launch backward's MMAs still pipelined."""
    import dataclasses

    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    shape, options = _attn_case(causal=True)
    options = dataclasses.replace(options, has_alibi=True)
    launches = plan_attention_bwd(shape, options, target=H200, config=AttentionConfig(fused_backward=True),
                                  alibi_grad="float32").launches
    ptx = assert_same_ptx(next(l for l in launches if l.kernel.endswith(":attn_bwd_kernel")),
                           _attn_dtypes("bfloat16"))
    assert_wgmma_pipelined(ptx, "one-launch attention backward with the ALiBi slopes' gradient")
    assert_same_ptx(next(l for l in launches if l.kernel.endswith(":attn_bwd_alibi_kernel")),
                     _attn_dtypes("bfloat16"))


def _global_accesses(ptx: str) -> list[str]:
    return re.findall(r"(?:ld|st)\.global[.\w]*", ptx)


@pytest.mark.parametrize("interleaved,positions", [(False, "sequence"), (True, "position_ids"), (False, "cu_seqlens")])
def test_rotary_kernel_compiles_identically_and_vectorised(interleaved, positions):
    """q and k of Llama-3-8B (32 + 8 heads of 128, bf16) in one launch: the same PTX from both launchers, and
    every access to q, k and the outputs a 16-byte vector (the only narrower ones: the float32 tables and
    the position indices)."""
    packed = positions == "cu_seqlens"
    lead = (32768,) if packed else (8, 4096)
    shape = check_rotary_args(x=((*lead, 32, 128), "bfloat16"), k=((*lead, 8, 128), "bfloat16"),
                              cos=((4096, 64), "float32"), sin=((4096, 64), "float32"),
                              position_ids=((8, 4096), "int64") if positions == "position_ids" else None,
                              cu_seqlens=((9,), "int32") if packed else None)
    plan = plan_rotary(shape, dtype="bfloat16", interleaved=interleaved, conjugate=False, inplace=False, target=H200)
    dtypes = {"x": "bfloat16", "k": "bfloat16", "out": "bfloat16", "out_k": "bfloat16", "cos": "float32",
              "sin": "float32", "position_ids": "int64", "cu_seqlens": "int32"}
    ptx = assert_same_ptx(plan.launches[0], dtypes)
    accesses = _global_accesses(ptx)
    assert sum(".v4." in a for a in accesses) >= 8, accesses
    narrow = [a for a in accesses if ".v4." not in a]
    assert all(a.startswith("ld.") and a.endswith((".b32", ".b64")) for a in narrow), narrow  # tables, indices


@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_kernels_compile_identically_and_vectorised(fused):
    """Llama-3-8B's MLP (32768 tokens x 14336, bf16), split and fused: the same PTX from both launchers and
    nothing but 16-byte loads and stores, forward and backward."""
    dtypes = {n: "bfloat16" for n in ("gate", "up", "x", "y", "dy", "dgate", "dup", "dx", "unused")}
    for plan in (plan_swiglu_fwd(32768, 14336, dtype="bfloat16", fused=fused, target=H200),
                 plan_swiglu_bwd(32768, 14336, dtype="bfloat16", fused=fused, target=H200)):
        accesses = _global_accesses(assert_same_ptx(plan.launches[0], dtypes))
        assert accesses and all(".v4." in a for a in accesses), accesses


# ------------------------------------------------------------------------- plan facts (no backend needed)

def test_pow2_divisor():
    assert pow2_divisor(2048, 128, 0) == 16
    assert pow2_divisor(72 * 8, 72) == 8
    assert pow2_divisor(1000, 16) == 8
    assert pow2_divisor(3579) == 1
    assert pow2_divisor() == 16


def test_attention_plans_state_stride_alignment():
    shape, options = _attn_case(causal=True, varlen=True)
    fwd = plan_attention_fwd(shape, options, target=H200).launches[0].constexpr_dict()
    assert fwd["STRIDE_ALIGN"] == 16 and fwd["LSE_ALIGN"] == 1  # lse head stride = total_q = 3579
    odd = plan_attention_fwd(shape, options, target=H200, strides={"k": (0, 4 * 136, 136)}).launches[0]
    assert odd.constexpr_dict()["STRIDE_ALIGN"] == 8


# -------------------------------------------------------------------- interpreted launches leave no trace

def _snapshot():
    return [(obj, dict(vars(obj))) for obj in _language_namespaces()]


def _interpret_layer_norm_dropout():
    """One interpreted launch whose kernel calls nested @triton.jit helpers (tl.sum, tl.rand, ...)."""
    plan = plan_norm_fwd(8, 32, x_dtype="float32", residual_dtype=None, is_rms=False, has_weight=False,
                         has_bias=False, has_post_residual=False, dropout_p=0.5, eps=1e-5, target=INTERPRETER)
    launch = plan.launches[0]
    x = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    env = {"x": x, "seed": np.array([7], np.int32)}
    env.update({s.name: np.zeros(s.shape, np.float32) for s in plan.buffers})
    args = ([HostArray(env[n]) for n in launch.inputs] + launch.scalar_values()
            + [HostArray(env[n]) for n in launch.outputs])
    get_kernel(launch.kernel, True)[launch.grid](*args, **launch.constexpr_dict())
    assert np.isfinite(env["y"]).all()


def test_interpreted_launch_restores_triton_language():
    before = _snapshot()
    _interpret_layer_norm_dropout()
    for (obj, saved), (_, now) in zip(before, _snapshot()):
        changed = sorted(n for n in set(saved) | set(now) if saved.get(n) is not now.get(n))
        assert not changed, f"{getattr(obj, '__name__', obj)}: left patched by the interpreter: {changed[:8]}"


def test_compile_after_interpreted_launch():
    _interpret_layer_norm_dropout()
    plan = plan_norm_fwd(512, 768, x_dtype="float32", residual_dtype=None, is_rms=False, has_weight=True,
                         has_bias=True, has_post_residual=True, dropout_p=0.2, eps=1e-5, target=H200)
    compile_as_jax_triton(plan.launches[0], _NORM_DTYPES)


def test_jax_launch_mode_names_the_variable(monkeypatch):
    """FLASHBRIDGE_JAX_LAUNCH picks the JAX launch path on a GPU; a value it does not know fails with the
    variable's name and the accepted values, before jax_triton is imported."""
    from flashbridge.jax_api import _runtime

    monkeypatch.delenv("FLASHBRIDGE_JAX_LAUNCH", raising=False)
    assert _runtime.launch_mode() == "ffi"
    monkeypatch.setenv("FLASHBRIDGE_JAX_LAUNCH", "legacy")
    assert _runtime.launch_mode() == "legacy"
    monkeypatch.setenv("FLASHBRIDGE_JAX_LAUNCH", "graphs")
    with pytest.raises(ValueError, match="FLASHBRIDGE_JAX_LAUNCH: expected one of ffi, legacy, got 'graphs'"):
        _runtime._jax_triton.__wrapped__()
