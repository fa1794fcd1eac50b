"""Property-based tests (hypothesis): per op family, random valid shapes, options and masks, both frameworks
on the CPU (Triton interpreter), against the float64 references.

Each family draws its cases from one strategy and checks the same things: the torch result against the
reference under the accuracy rule (``helpers.assert_close``: twice the error of the reference rounded to the
dtype plus a floor), gradients where the op has them, and the JAX result bit for bit equal to torch's (the
same kernels on the same device). Draws are derandomized (a fixed sequence per test, no example database),
so CI is reproducible; ``max_examples`` keeps each family within ~30 s of interpreter time.
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


def bounded(n: int):
    """Hypothesis settings of one family: ``n`` examples, no deadline (the interpreter is slow), derandomized,
    no database, and no shrinking (each step reruns kernels in the interpreter: minutes; the failing draw is
    printed as found)."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 2e-5, "float16": 1e-3, "bfloat16": 4e-3}


def _t(a, dtype="float32", grad=False):
    return torch.tensor(np.asarray(a), dtype=TORCH[dtype], requires_grad=grad)


def _same_bits(torch_value, jax_value, name):
    np.testing.assert_array_equal(np64(jax_value), np64(torch_value), err_msg=f"{name}: torch and JAX differ")


def _rng(data):
    return np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))


# ------------------------------------------------------------------------------------------------- norms

@bounded(12)
@given(data=st.data())
def test_norms(data):
    op = data.draw(st.sampled_from(["rms", "ln"]), label="op")
    dtype = data.draw(st.sampled_from(["float32", "bfloat16", "float16"]), label="dtype")
    lead = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=2), label="lead")
    n = data.draw(st.sampled_from([1, 2, 7, 16, 33, 100, 257]), label="width")
    has_w, has_b = data.draw(st.booleans(), label="weight"), op == "ln" and data.draw(st.booleans(), label="bias")
    has_res = data.draw(st.booleans(), label="residual")
    eps = data.draw(st.sampled_from([1e-6, 1e-5, 1e-2]), label="eps")
    rng = _rng(data)
    shape = (*lead, n)
    # float32 rows of any magnitude 1e-20 .. 1e20 (each row its own); 16-bit dtypes stay in their range
    exp = rng.uniform(-20, 20, (*lead, 1)) if dtype == "float32" else rng.uniform(-2, 2, (*lead, 1))
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


@bounded(8)
@given(case=attention_cases(), data=st.data())
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
    assert_close(out, ro, rounded(ro, "float32"), name="out", floor=FLOOR["float32"])
    finite = np.isfinite(rl)
    assert (np.isfinite(np64(lse)) == finite).all(), "lse: -inf exactly for the rows that see no key"
    np.testing.assert_allclose(np64(lse)[finite], rl[finite], rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert_close(got, want, rounded(want, "float32"), name=name, floor=FLOOR["float32"])

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
