"""Property-based tests (hypothesis): per op family, random valid shapes, options and masks, both frameworks
on the CPU (Triton interpreter), against the float64 references.

Each family draws its cases from one strategy and checks the same things: the torch result against the
reference under the accuracy rule (``helpers.assert_close``: twice the error of the reference rounded to the
dtype plus a floor), gradients where the op has them, and the JAX result bit for bit equal to torch's (the
same kernels on the same device). Draws are derandomized (a fixed sequence per test, no example database),
so CI is reproducible; ``max_examples`` keeps each family within ~30 s of interpreter time, and a few of
them (the first draws of the same sequence) run in the default selection, the rest with the slow tests.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from helpers import assert_close, assert_close_rowwise, np64, rounded, torch_to_jax

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import masks  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402
from flashbridge.reference import attention as RA  # noqa: E402
from flashbridge.reference import cross_entropy as RCE  # noqa: E402
from flashbridge.reference import decode as RD  # noqa: E402
from flashbridge.reference import mla as RM  # noqa: E402
from flashbridge.reference import norms as RN  # noqa: E402
from flashbridge.reference import rotary as RR  # noqa: E402
from flashbridge.reference import swiglu as RS  # noqa: E402


def bounded(full: int, quick: int, **strategies):
    """One family's property test, twice: ``quick`` examples in the default run and ``full`` in the slow one
    (``-m slow``; CI runs both), each drawn from ``strategies`` (hypothesis ``given``) with no deadline (the
    interpreter is slow), derandomized (the quick draws are the full run's first ones), no database, and no
    shrinking (each step reruns kernels in the interpreter: minutes; the failing draw is printed as found)."""
    def decorate(body):
        @pytest.mark.parametrize("examples", [pytest.param(quick, id="quick"),
                                              pytest.param(full, id="full", marks=pytest.mark.slow)])
        def test(examples):
            settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                     phases=(Phase.explicit, Phase.generate),
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(
                given(**strategies)(body))()

        test.__name__, test.__qualname__, test.__doc__ = body.__name__, body.__qualname__, body.__doc__
        return test
    return decorate


TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 4e-3}


def _check_attention(out, lse, grads, ro, rl, rgrads):
    """float32 attention against the float64 reference: out, lse (-inf exactly where the reference's is),
    dq / dk / dv (/ dsinks)."""
    assert_close(out, ro, rounded(ro, "float32"), name="out", floor=FLOOR["float32"])
    finite = np.isfinite(rl)
    assert (np.isfinite(np64(lse)) == finite).all(), "lse: -inf exactly for the rows that see no key"
    np.testing.assert_allclose(np64(lse)[finite], rl[finite], rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert_close(got, want, rounded(want, "float32"), name=name, floor=FLOOR["float32"])


def _t(a, dtype="float32", grad=False):
    return torch.tensor(np.asarray(a), dtype=TORCH[dtype], requires_grad=grad)


def _same_bits(torch_value, jax_value, name):
    np.testing.assert_array_equal(np64(jax_value), np64(torch_value), err_msg=f"{name}: torch and JAX differ")


def _rng(data):
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


# ------------------------------------------------------------------------------------------------- norms

@bounded(12, 4, data=st.data())
def test_norms(data):
    op = data.draw(st.sampled_from(["rms", "ln"]), label="op")
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
    lead = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2), label="lead")
    n = data.draw(st.sampled_from([1, 2, 7, 16, 33, 100, 257]), label="width")
    has_w, has_b = data.draw(st.booleans(), label="weight"), op == "ln" and data.draw(st.booleans(), label="bias")
    has_res = data.draw(st.booleans(), label="residual")
    eps = data.draw(st.sampled_from([1e-6, 1e-5, 1e-2, 2.0 ** -126]), label="eps")
    rng = _rng(data)
    shape = (*lead, n)
    # float32 rows of magnitudes 1e-20 .. 1e20 (each row its own: squares overflow or underflow unscaled);
    # 16-bit dtypes stay in their range
    if dtype == "float32":
        exp = rng.choice([-20.0, -10.0, 0.0, 10.0, 20.0], (*lead, 1)) + rng.uniform(-1, 1, (*lead, 1))
    else:
        exp = rng.uniform(-2, 2, (*lead, 1))
    x = rounded((rng.standard_normal(shape) + (2.0 if op == "ln" else 0.0)) * 10.0 ** exp, dtype)
    res = rounded(rng.standard_normal(shape) * 10.0 ** exp, dtype) if has_res else None
    w = rounded(rng.standard_normal(n) + 1.0, dtype) if has_w else None
    b = rounded(rng.standard_normal(n), dtype) if has_b else None
    dy = rounded(rng.standard_normal(shape), dtype)
    h = x if res is None else rounded(x + res, dtype)
    if op == "rms":
        ref = RN.rms_norm(h, w, eps=eps)
        ref_dx, ref_dw, _ = RN.rms_norm_bwd(dy, h, w, eps=eps)
        ref_db = None
    else:
        ref = RN.layer_norm(h, w, b, eps=eps)
        ref_dx, ref_dw, ref_db, _ = RN.layer_norm_bwd(dy, h, w, b, eps=eps)

    tx, tres, tw, tb = (None if a is None else _t(a, dtype, True) for a in (x, res, w, b))
    fn = ft.rms_norm if op == "rms" else ft.layer_norm
    extra = () if op == "rms" else (tb,)
    out = fn(tx, tw, *extra, eps=eps, residual=tres)
    ty = out[0] if has_res else out
    ty.backward(_t(dy, dtype))

    def jfn(x, w, b, res):
        o = (fj.rms_norm(x, w, eps=eps, residual=res) if op == "rms"
             else fj.layer_norm(x, w, b, eps=eps, residual=res))
        return o[0] if has_res else o

    jx, jres, jw, jb = (None if a is None else jnp.asarray(a, dtype) for a in (x, res, w, b))
    jy, vjp = jax.vjp(jfn, jx, jw, jb, jres)
    jdx, jdw, jdb, _ = vjp(jnp.asarray(dy, dtype))

    floor = FLOOR[dtype]
    assert_close_rowwise(ty, ref, rounded(ref, dtype), name="y", floor=floor)
    # dx = rstd * (g - xhat * mean(g * xhat) ...) cancels when |xhat| ~ 1 (one column, or eps >> var): measure
    # each row in units of rstd * max|g|, the size of its terms
    hc = h - (0.0 if op == "rms" else h.mean(-1, keepdims=True))
    rstd = 1.0 / np.sqrt(np.mean(hc * hc, axis=-1) + eps)
    g_max = np.max(np.abs(dy * (1.0 if w is None else w)), axis=-1)
    assert_close_rowwise(tx.grad, ref_dx, rounded(ref_dx, dtype), name="dx", floor=floor, unit=rstd * g_max)
    if has_w:
        assert_close(tw.grad, ref_dw, rounded(ref_dw, dtype), name="dweight", floor=floor * 10)
        _same_bits(tw.grad, jdw, "dweight")
    if has_b:
        assert_close(tb.grad, ref_db, rounded(ref_db, dtype), name="dbias", floor=floor * 10)
    _same_bits(ty, jy, "y")
    _same_bits(tx.grad, jdx, "dx")


# --------------------------------------------------------------------------------------------- attention

@st.composite
def attention_cases(draw):
    varlen = draw(st.booleans(), label="varlen")
    n_seqs = draw(st.integers(1, 3 if varlen else 2), label="batch")
    lens_q = draw(st.lists(st.integers(1 if not varlen else 0, 40), min_size=n_seqs, max_size=n_seqs), label="sq")
    if varlen:
        lens_k = draw(st.lists(st.integers(0, 40), min_size=n_seqs, max_size=n_seqs), label="sk")
        lens_q[0], lens_k[-1] = max(lens_q[0], 1), max(lens_k[-1], 1)  # packed tensors are never empty
    else:
        lens_q = [lens_q[0]] * n_seqs
        lens_k = [draw(st.integers(1, 40), label="sk")] * n_seqs
    hkv = draw(st.integers(1, 2), label="hkv")
    group = draw(st.sampled_from([1, 2, 3]), label="group")
    d = draw(st.sampled_from([16, 24, 32]), label="d")
    dv = draw(st.sampled_from([d, 16]), label="dv")
    causal = draw(st.booleans(), label="causal")
    left = draw(st.sampled_from([-1, 0, 3, 17]), label="left")
    right = 0 if causal else draw(st.sampled_from([-1, 0, 5]), label="right")
    return dict(varlen=varlen, lens_q=lens_q, lens_k=lens_k, hkv=hkv, hq=hkv * group, d=d, dv=dv,
                causal=causal, window=(left, right) if (left, right) != (-1, -1) else (-1, -1),
                softcap=draw(st.sampled_from([0.0, 0.0, 5.0]), label="softcap"),
                sinks=draw(st.booleans(), label="sinks"), alibi=draw(st.booleans(), label="alibi"),
                scale=draw(st.sampled_from([None, 0.3]), label="softmax_scale"))


@bounded(8, 3, case=attention_cases(), data=st.data())
def test_attention(case, data):
    rng = _rng(data)
    c = case
    if c["varlen"]:
        tq, tk = sum(c["lens_q"]), sum(c["lens_k"])
        q_shape, k_shape, v_shape = (tq, c["hq"], c["d"]), (tk, c["hkv"], c["d"]), (tk, c["hkv"], c["dv"])
        cu_q = np.concatenate([[0], np.cumsum(c["lens_q"])]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(c["lens_k"])]).astype(np.int32)
        seq = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(max(c["lens_q"]), 1),
                   max_seqlen_k=max(max(c["lens_k"]), 1))
    else:
        b, sq, sk = len(c["lens_q"]), c["lens_q"][0], c["lens_k"][0]
        q_shape, k_shape, v_shape = (b, sq, c["hq"], c["d"]), (b, sk, c["hkv"], c["d"]), (b, sk, c["hkv"], c["dv"])
        seq = {}
    q, k, v = (rounded(rng.standard_normal(s), "float32") for s in (q_shape, k_shape, v_shape))
    sinks = rounded(rng.standard_normal(c["hq"]), "float32") if c["sinks"] else None
    alibi = rounded(rng.uniform(0.05, 0.5, c["hq"]), "float32") if c["alibi"] else None
    opts = dict(causal=c["causal"], window_size=c["window"], softcap=c["softcap"], softmax_scale=c["scale"])
    ro, rl = RA.flash_attention(q, k, v, alibi_slopes=alibi, sinks=sinks, **opts, **seq)
    dout = rounded(rng.standard_normal(ro.shape), "float32")
    rgrads = RA.flash_attention_bwd(dout, q, k, v, alibi_slopes=alibi, sinks=sinks, **opts, **seq)

    tq_, tk_, tv_ = (_t(a, grad=True) for a in (q, k, v))
    ts = None if sinks is None else _t(sinks, grad=True)
    tseq = {n: (torch.tensor(a) if isinstance(a, np.ndarray) else a) for n, a in seq.items()}
    out, lse = ft.flash_attention(tq_, tk_, tv_, alibi_slopes=None if alibi is None else _t(alibi), sinks=ts,
                                  return_lse=True, **opts, **tseq)
    leaves = [tq_, tk_, tv_] + ([ts] if ts is not None else [])
    grads = torch.autograd.grad(out, leaves, _t(dout))
    _check_attention(out, lse, grads, ro, rl, rgrads)

    def jfn(q, k, v, s):
        return fj.flash_attention(q, k, v, alibi_slopes=None if alibi is None else jnp.asarray(alibi, jnp.float32),
                                  sinks=s, return_lse=True, **opts,
                                  **{n: (jnp.asarray(a) if isinstance(a, np.ndarray) else a) for n, a in seq.items()})

    jargs = [jnp.asarray(a, jnp.float32) for a in (q, k, v)] + [None if sinks is None else jnp.asarray(sinks)]
    (jo, jl), vjp = jax.vjp(jfn, *jargs)
    jgrads = vjp((jnp.asarray(dout, jnp.float32), jnp.zeros_like(jl)))
    _same_bits(out, jo, "out")
    _same_bits(lse, jl, "lse")
    for name, tg, jg in zip(("dq", "dk", "dv", "dsinks"), grads, jgrads):
        _same_bits(tg, jg, name)


# ------------------------------------------------------------------------------------------------ decode

def _page(rng, logical, lens, page_size, spare=2):
    """A paged pool ``(n_pages, page_size, ...)`` holding the rows of ``logical`` ``(B, S_max, ...)`` in shuffled
    pages (random values elsewhere) and its int32 block table, -1 past each sequence's pages."""
    b, s_max = logical.shape[:2]
    max_pages = -(-s_max // page_size)
    n_pages = b * max_pages + spare
    perm = rng.permutation(n_pages)
    pool = rng.standard_normal((n_pages, page_size) + logical.shape[2:]).astype(logical.dtype)
    table = np.full((b, max_pages), -1, np.int32)
    for i, length in enumerate(lens):
        for j in range(-(-length // page_size)):
            table[i, j] = perm[i * max_pages + j]
            rows = logical[i, j * page_size:(j + 1) * page_size]
            pool[table[i, j], :len(rows)] = rows
    return pool, table


def _to_fp8(x, scale):
    """e4m3 bytes of ``x / scale`` (ml_dtypes), as a float64 array of the stored values and a torch fp8 tensor."""
    import ml_dtypes

    stored = (x / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return stored.astype(np.float64), torch.from_numpy(stored.view(np.uint8)).view(torch.float8_e4m3fn)


@bounded(15, 5, data=st.data())
def test_decode(data):
    d = data.draw
    b, sq = d(st.integers(1, 3), label="batch"), d(st.integers(1, 3), label="sq")
    lens = d(st.lists(st.integers(0, 48), min_size=b, max_size=b), label="lens")
    hkv, group = d(st.integers(1, 2), label="hkv"), d(st.sampled_from([1, 2, 4]), label="group")
    dqk = d(st.sampled_from([16, 32]), label="dqk")
    dv = d(st.sampled_from([dqk, 16]), label="dv")
    layout, page_size = d(st.sampled_from(["NHD", "HND"]), label="layout"), d(st.sampled_from([None, 4, 16]),
                                                                               label="page_size")
    fp8 = d(st.sampled_from([None, None, "tensor", "head"]), label="fp8")
    opts = dict(causal=d(st.booleans(), label="causal"), window_size=(d(st.sampled_from([-1, 0, 5]), label="left"), -1),
                softcap=d(st.sampled_from([0.0, 8.0]), label="softcap"), num_splits=d(st.sampled_from([None, 1, 3]),
                                                                                        label="num_splits"))
    sinks, alibi = d(st.booleans(), label="sinks"), d(st.sampled_from([None, "heads", "batch"]), label="alibi")
    rng = _rng(data)
    hq, s_max = hkv * group, max(max(lens), 1)
    q = rounded(rng.standard_normal((b, sq, hq, dqk)), "float32")
    kw_ref, kw = {}, {}
    caches, ref_caches = [], []
    for dim, name in ((dqk, "k"), (dv, "v")):
        logical = rounded(rng.standard_normal((b, s_max, hkv, dim)), "float32")
        if page_size is not None:
            logical, table = _page(rng, logical, lens, page_size)
        if layout == "HND":
            logical = np.ascontiguousarray(np.swapaxes(logical, 1, 2))
        if fp8 is None:
            ref_caches.append(logical)
            caches.append(_t(logical))
        else:
            scale = rng.uniform(0.25, 0.75, (hkv,) if fp8 == "head" else ()).astype(np.float32)
            shaped = scale.reshape((1, hkv, 1, 1) if layout == "HND" else (1, 1, hkv, 1)) if fp8 == "head" else scale
            stored, t8 = _to_fp8(logical, shaped)
            ref_caches.append(stored)
            caches.append(t8)
            kw_ref[f"{name}_scale"], kw[f"{name}_scale"] = scale.astype(np.float64), torch.from_numpy(scale)
    if page_size is not None:
        kw_ref["block_table"], kw["block_table"] = table, torch.from_numpy(table)
    if sinks:
        s = rounded(rng.standard_normal(hq), "float32")
        kw_ref["sinks"], kw["sinks"] = s, _t(s)
    if alibi:
        a = rounded(rng.uniform(0.05, 0.4, (hq,) if alibi == "heads" else (b, hq)), "float32")
        kw_ref["alibi_slopes"], kw["alibi_slopes"] = a, _t(a)
    lens_np = np.asarray(lens, np.int32)
    ro, rl = RD.decode_attention(q, *ref_caches, cache_seqlens=lens_np, kv_layout=layout, **opts, **kw_ref)
    out, lse = ft.decode_attention(_t(q), *caches, cache_seqlens=torch.from_numpy(lens_np), kv_layout=layout,
                                   return_lse=True, **opts, **kw)
    assert_close(out, ro, rounded(ro, "float32"), name="out", floor=FLOOR["float32"])
    finite = np.isfinite(rl)
    assert (np.isfinite(np64(lse)) == finite).all(), "lse: -inf exactly for the rows that see no key"
    np.testing.assert_allclose(np64(lse)[finite], rl[finite], rtol=1e-5, atol=1e-5)
    jo, jl = fj.decode_attention(torch_to_jax(_t(q)), *(torch_to_jax(c) for c in caches),
                                 cache_seqlens=jnp.asarray(lens_np), kv_layout=layout, return_lse=True, **opts,
                                 **{n: torch_to_jax(t) for n, t in kw.items()})
    _same_bits(out, jo, "out")
    _same_bits(lse, jl, "lse")


# ----------------------------------------------------------------------------------------- cross-entropy

@bounded(15, 5, data=st.data())
def test_cross_entropy(data):
    d = data.draw
    lead = d(st.lists(st.integers(1, 9), min_size=1, max_size=2), label="lead")
    vocab = d(st.sampled_from([2, 5, 17, 130, 1000]), label="vocab")
    dtype = d(st.sampled_from(["float32", "bfloat16"]), label="dtype")
    opts = dict(label_smoothing=d(st.sampled_from([0.0, 0.1]), label="label_smoothing"),
                z_loss=d(st.sampled_from([0.0, 1e-3]), label="z_loss"),
                logit_softcap=d(st.sampled_from([0.0, 15.0]), label="logit_softcap"),
                reduction=d(st.sampled_from(["mean", "sum", "none"]), label="reduction"),
                ignore_index=d(st.sampled_from([-100, 0]), label="ignore_index"))
    weighted = d(st.booleans(), label="weight")
    rng = _rng(data)
    logits = rounded(rng.standard_normal((*lead, vocab)) * 3.0, dtype)
    labels = rng.integers(0, vocab, lead).astype(np.int64)
    ignored = rng.random(lead) < 0.3
    labels = np.where(ignored, opts["ignore_index"], labels)
    labels.reshape(-1)[0] = 1 if opts["ignore_index"] != 1 else 0  # at least one token counts (mean stays finite)
    weight = rounded(rng.uniform(0.2, 2.0, vocab), "float32") if weighted else None
    ref = RCE.cross_entropy(logits, labels, weight=weight, **opts)
    dloss = rounded(rng.standard_normal(lead), "float32") if opts["reduction"] == "none" else 1.0
    ref_grad = RCE.cross_entropy_bwd(dloss, logits, labels, weight=weight, **opts)

    tl_ = _t(logits, dtype, True)
    loss = ft.cross_entropy(tl_, torch.from_numpy(labels), weight=None if weight is None else _t(weight), **opts)
    loss.backward(_t(dloss) if opts["reduction"] == "none" else None)
    assert_close(loss, ref, rounded(ref, "float32"), name="loss", floor=FLOOR["float32"])
    assert_close(tl_.grad, ref_grad, rounded(ref_grad, dtype), name="dlogits", floor=FLOOR[dtype])

    jw = None if weight is None else jnp.asarray(weight, jnp.float32)
    jloss, vjp = jax.vjp(lambda x: fj.cross_entropy(x, jnp.asarray(labels, jnp.int32), weight=jw, **opts),
                         jnp.asarray(logits, dtype))
    (jgrad,) = vjp(jnp.asarray(dloss, jnp.float32) if opts["reduction"] == "none" else jnp.ones((), jnp.float32))
    if opts["reduction"] == "none":
        _same_bits(loss, jloss, "loss")
    else:  # the rows' sum is a framework reduction (torch.sum / jnp.sum): its order may differ by an ulp
        np.testing.assert_allclose(np64(jloss), np64(loss), rtol=4e-7, err_msg="loss: torch and JAX differ")
    _same_bits(tl_.grad, jgrad, "dlogits")


# ------------------------------------------------------------------------------------------------ rotary

@bounded(15, 5, data=st.data())
def test_rotary(data):
    d = data.draw
    packed = d(st.booleans(), label="packed")
    heads, dim = d(st.integers(1, 3), label="heads"), d(st.sampled_from([8, 16, 24, 64]), label="head_dim")
    rot = d(st.sampled_from(sorted({dim, dim // 2 + (dim // 2) % 2, 2})), label="rotary_dim")
    interleaved, dtype = d(st.booleans(), label="interleaved"), d(st.sampled_from(["float32", "bfloat16"]),
                                                                   label="dtype")
    rng = _rng(data)
    kw_ref, kw = {}, {}
    if packed:
        lens = d(st.lists(st.integers(1, 20), min_size=1, max_size=3), label="lens")
        shape, table_len = (sum(lens), heads, dim), max(lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        kw_ref["cu_seqlens"], kw["cu_seqlens"] = cu, torch.from_numpy(cu)
    else:
        b, s = d(st.integers(1, 2), label="batch"), d(st.integers(1, 30), label="seqlen")
        shape, table_len = (b, s, heads, dim), s
        if d(st.booleans(), label="position_ids"):
            table_len = 64
            pos = rng.integers(0, table_len, (b, s)).astype(np.int64)
            kw_ref["position_ids"], kw["position_ids"] = pos, torch.from_numpy(pos)
    cos, sin = (rounded(t, "float32") for t in RR.cos_sin_table(table_len, rot))
    x, dy = (rounded(rng.standard_normal(shape), dtype) for _ in range(2))
    ref = RR.rotary_embedding(x, cos, sin, interleaved=interleaved, **kw_ref)
    ref_dx = RR.rotary_embedding_bwd(dy, cos, sin, interleaved=interleaved, **kw_ref)
    tx = _t(x, dtype, True)
    y = ft.rotary_embedding(tx, _t(cos), _t(sin), interleaved=interleaved, **kw)
    y.backward(_t(dy, dtype))
    assert_close(y, ref, rounded(ref, dtype), name="y", floor=FLOOR[dtype])
    assert_close(tx.grad, ref_dx, rounded(ref_dx, dtype), name="dx", floor=FLOOR[dtype])
    jkw = {n: jnp.asarray(v.numpy()) for n, v in kw.items()}
    jy, vjp = jax.vjp(lambda x: fj.rotary_embedding(x, jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32),
                                                    interleaved=interleaved, **jkw), jnp.asarray(x, dtype))
    (jdx,) = vjp(jnp.asarray(dy, dtype))
    _same_bits(y, jy, "y")
    _same_bits(tx.grad, jdx, "dx")


# ------------------------------------------------------------------------------------------------ swiglu

@bounded(15, 5, data=st.data())
def test_swiglu(data):
    d = data.draw
    lead = d(st.lists(st.integers(1, 7), min_size=1, max_size=2), label="lead")
    inter = d(st.sampled_from([1, 7, 64, 300]), label="intermediate")
    fused, dtype = d(st.booleans(), label="fused"), d(st.sampled_from(["float32", "bfloat16", "float16"]),
                                                      label="dtype")
    rng = _rng(data)
    gate = rounded(rng.standard_normal((*lead, 2 * inter if fused else inter)) * 3.0, dtype)
    up = None if fused else rounded(rng.standard_normal((*lead, inter)), dtype)
    dy = rounded(rng.standard_normal((*lead, inter)), dtype)
    ref = RS.swiglu(gate, up)
    ref_grads = RS.swiglu_bwd(dy, gate, up)
    ref_grads = (ref_grads,) if fused else ref_grads
    tg, tu = _t(gate, dtype, True), None if fused else _t(up, dtype, True)
    y = ft.swiglu(tg, tu)
    y.backward(_t(dy, dtype))
    assert_close(y, ref, rounded(ref, dtype), name="y", floor=FLOOR[dtype])
    for name, got, want in zip(("dgate", "dup"), (tg.grad,) if fused else (tg.grad, tu.grad), ref_grads):
        assert_close(got, want, rounded(want, dtype), name=name, floor=FLOOR[dtype])
    jargs = (jnp.asarray(gate, dtype),) if fused else (jnp.asarray(gate, dtype), jnp.asarray(up, dtype))
    jy, vjp = jax.vjp(lambda *a: fj.swiglu(*a), *jargs)
    jgrads = vjp(jnp.asarray(dy, dtype))
    _same_bits(y, jy, "y")
    for name, tg_, jg in zip(("dgate", "dup"), (tg.grad,) if fused else (tg.grad, tu.grad), jgrads):
        _same_bits(tg_, jg, name)


# ----------------------------------------------------------------------------------- block-sparse masks

@st.composite
def block_masks(draw):
    """A BlockMask from one of the builders (or a combination), random sizes and block shapes; returns
    (mask, batch) with the batch the mask was built for."""
    kind = draw(st.sampled_from(["causal", "window", "streaming", "document", "longformer", "dense", "and_or"]),
                label="kind")
    bs = draw(st.sampled_from([16, 32, (16, 32), (32, 16)]), label="block_size")
    s = draw(st.integers(1, 50), label="seqlen")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="mask_seed"))
    batch = 1
    if kind == "causal":
        m = masks.causal(s, draw(st.integers(1, 50), label="seqlen_k"), block_size=bs)
    elif kind == "window":
        m = masks.sliding_window(s, draw(st.integers(0, 20), label="left"), draw(st.integers(0, 6), label="right"),
                                 block_size=bs)
    elif kind == "streaming":
        m = masks.streaming(s, draw(st.integers(1, 4), label="sinks"), draw(st.integers(0, 12), label="window"),
                            block_size=bs)
    elif kind == "document":
        batch = draw(st.integers(1, 2), label="batch")
        cuts = [sorted(rng.choice(np.arange(1, s), size=min(2, s - 1), replace=False)) if s > 1 else []
                for _ in range(batch)]
        lengths = [np.diff([0, *c, s]).tolist() for c in cuts]
        m = masks.document(lengths if batch > 1 else lengths[0], causal=draw(st.booleans(), label="causal"),
                           block_size=bs)
    elif kind == "longformer":
        m = masks.longformer(s, draw(st.integers(0, 8), label="window"),
                             sorted(set(rng.integers(0, s, 2).tolist())), block_size=bs)
    elif kind == "dense":
        batch, heads = draw(st.integers(1, 2), label="batch"), draw(st.integers(1, 2), label="mask_heads")
        sk = draw(st.integers(1, 50), label="seqlen_k")
        m = masks.from_dense(rng.random((batch, heads, s, sk)) < draw(st.floats(0.0, 1.0), label="density"),
                             block_size=bs)
    else:
        m = (masks.causal(s, block_size=bs) & masks.from_dense(rng.random((s, s)) < 0.7, block_size=bs)) \
            | masks.sliding_window(s, 2, 2, block_size=bs)
    return m, batch


@bounded(7, 2, mask=block_masks(), data=st.data())
def test_block_sparse_attention(mask, data):
    m, batch = mask
    d = data.draw
    hkv = d(st.integers(1, 2), label="hkv")
    hq = hkv * d(st.sampled_from([1, 2]), label="group")
    if m.shape[1] > 1:  # a per-head mask: one head of it per query head
        hq, hkv = m.shape[1], hkv if m.shape[1] % hkv == 0 else 1
    dim = d(st.sampled_from([16, 32]), label="d")
    softcap, with_sinks = d(st.sampled_from([0.0, 4.0]), label="softcap"), d(st.booleans(), label="sinks")
    rng = _rng(data)
    sq, sk = m.seq_len_q, m.seq_len_k
    q = rounded(rng.standard_normal((batch, sq, hq, dim)), "float32")
    k, v = (rounded(rng.standard_normal((batch, sk, hkv, dim)), "float32") for _ in range(2))
    sinks = rounded(rng.standard_normal(hq), "float32") if with_sinks else None
    dense = m.to_dense()
    ro, rl = RA.flash_attention(q, k, v, mask=dense, softcap=softcap, sinks=sinks)
    dout = rounded(rng.standard_normal(ro.shape), "float32")
    rgrads = RA.flash_attention_bwd(dout, q, k, v, mask=dense, softcap=softcap, sinks=sinks)

    leaves = [_t(a, grad=True) for a in (q, k, v)] + ([_t(sinks, grad=True)] if with_sinks else [])
    out, lse = ft.flash_attention(*leaves[:3], block_mask=m, softcap=softcap,
                                  sinks=leaves[3] if with_sinks else None, return_lse=True)
    grads = torch.autograd.grad(out, leaves, _t(dout))
    _check_attention(out, lse, grads, ro, rl, rgrads)

    def jfn(q, k, v, s):
        return fj.flash_attention(q, k, v, block_mask=m, softcap=softcap, sinks=s, return_lse=True)

    jargs = [jnp.asarray(a, jnp.float32) for a in (q, k, v)] + [None if sinks is None else jnp.asarray(sinks)]
    (jo, jl), vjp = jax.vjp(jfn, *jargs)
    jgrads = vjp((jnp.asarray(dout, jnp.float32), jnp.zeros_like(jl)))
    _same_bits(out, jo, "out")
    _same_bits(lse, jl, "lse")
    for name, tg, jg in zip(("dq", "dk", "dv", "dsinks"), grads, jgrads):
        _same_bits(tg, jg, name)


# --------------------------------------------------------------------------------------------------- MLA

@bounded(8, 2, data=st.data())
def test_mla_attention(data):
    d = data.draw
    b, sq, sk = d(st.integers(1, 2), label="batch"), d(st.integers(1, 24), label="sq"), d(st.integers(1, 40),
                                                                                           label="sk")
    heads, (dqk, dv) = d(st.integers(1, 4), label="heads"), d(st.sampled_from([(24, 16), (48, 32), (40, 40)]),
                                                             label="dims")
    causal, topk = d(st.booleans(), label="causal"), d(st.sampled_from([0, 0, 4, 9]), label="topk")
    rng = _rng(data)
    q = rounded(rng.standard_normal((b, sq, heads, dqk)), "float32")
    kv = rounded(rng.standard_normal((b, sk, dqk)), "float32")
    indices = None
    if topk:  # distinct positions per query, -1 padding and entries past Sk (skipped)
        indices = np.stack([np.stack([np.concatenate([rng.permutation(sk)[:topk - 2], [-1, sk + 3]])
                                      for _ in range(sq)]) for _ in range(b)]).astype(np.int32)
    ro, rl = RM.mla_attention(q, kv, head_dim_v=dv, causal=causal, indices=indices)
    dout = rounded(rng.standard_normal(ro.shape), "float32")
    ref_dq, ref_dkv = RM.mla_attention_bwd(dout, q, kv, head_dim_v=dv, causal=causal, indices=indices)
    tq_, tkv = _t(q, grad=True), _t(kv, grad=True)
    tidx = None if indices is None else torch.from_numpy(indices)
    out, lse = ft.mla_attention(tq_, tkv, head_dim_v=dv, causal=causal, indices=tidx, return_lse=True)
    dq, dkv = torch.autograd.grad(out, (tq_, tkv), _t(dout))
    assert_close(out, ro, rounded(ro, "float32"), name="out", floor=FLOOR["float32"])
    finite = np.isfinite(rl)
    assert (np.isfinite(np64(lse)) == finite).all(), "lse: -inf exactly for the rows that see no key"
    np.testing.assert_allclose(np64(lse)[finite], rl[finite], rtol=1e-5, atol=1e-5)
    assert_close(dq, ref_dq, rounded(ref_dq, "float32"), name="dq", floor=FLOOR["float32"])
    assert_close(dkv, ref_dkv, rounded(ref_dkv, "float32"), name="dkv", floor=FLOOR["float32"])
    jidx = None if indices is None else jnp.asarray(indices)
    (jo, jl), vjp = jax.vjp(lambda q, kv: fj.mla_attention(q, kv, head_dim_v=dv, causal=causal, indices=jidx,
                                                           return_lse=True),
                            jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32))
    jdq, jdkv = vjp((jnp.asarray(dout, jnp.float32), jnp.zeros_like(jl)))
    for name, tv, jv in (("out", out, jo), ("lse", lse, jl), ("dq", dq, jdq), ("dkv", dkv, jdkv)):
        _same_bits(tv, jv, name)


@bounded(12, 4, data=st.data())
def test_mla_decode(data):
    d = data.draw
    b, sq = d(st.integers(1, 3), label="batch"), d(st.integers(1, 2), label="sq")
    lens = d(st.lists(st.integers(0, 40), min_size=b, max_size=b), label="lens")
    heads, (dqk, dv) = d(st.sampled_from([1, 4, 16]), label="heads"), d(st.sampled_from([(24, 16), (48, 32)]),
                                                                        label="dims")
    page_size, fp8 = d(st.sampled_from([None, 4, 16]), label="page_size"), d(st.booleans(), label="fp8")
    num_splits = d(st.sampled_from([None, 1, 2]), label="num_splits")
    rng = _rng(data)
    q = rounded(rng.standard_normal((b, sq, heads, dqk)), "float32")
    cache = rounded(rng.standard_normal((b, max(max(lens), 1), dqk)), "float32")
    kw_ref, kw = {}, {}
    if page_size is not None:
        cache, table = _page(rng, cache, lens, page_size)
        kw_ref["block_table"], kw["block_table"] = table, torch.from_numpy(table)
    if fp8:
        scale = np.float32(rng.uniform(0.25, 0.75))
        ref_cache, t_cache = _to_fp8(cache, scale)
        kw_ref["kv_scale"], kw["kv_scale"] = np.float64(scale), torch.tensor(scale)
    else:
        ref_cache, t_cache = cache, _t(cache)
    lens_np = np.asarray(lens, np.int32)
    ro, rl = RM.mla_decode(q, ref_cache, cache_seqlens=lens_np, head_dim_v=dv, **kw_ref)
    out, lse = ft.mla_decode(_t(q), t_cache, cache_seqlens=torch.from_numpy(lens_np), head_dim_v=dv,
                             num_splits=num_splits, return_lse=True, **kw)
    assert_close(out, ro, rounded(ro, "float32"), name="out", floor=FLOOR["float32"])
    finite = np.isfinite(rl)
    assert (np.isfinite(np64(lse)) == finite).all(), "lse: -inf exactly for the rows that see no key"
    np.testing.assert_allclose(np64(lse)[finite], rl[finite], rtol=1e-5, atol=1e-5)
    jo, jl = fj.mla_decode(jnp.asarray(q, jnp.float32), torch_to_jax(t_cache), cache_seqlens=jnp.asarray(lens_np),
                           head_dim_v=dv, num_splits=num_splits, return_lse=True,
                           **{n: torch_to_jax(t) for n, t in kw.items()})
    _same_bits(out, jo, "out")
    _same_bits(lse, jl, "lse")
