"""FlashAttention family on the CPU (Triton interpreter): reference, torch and JAX front-ends, drop-ins.

Every kernel result is compared with the float64 reference (flashbridge.reference.attention) under the
flash-attn rule: error <= 2 x the error of a naive implementation in the same dtype + a small floor.
Shapes are small (the interpreter pays per program and per operation) but odd everywhere.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge.reference import attention as ref
from helpers import assert_close, forward_with_config, naive_torch, np64, score_mod_inputs, torch_to_jax

torch_api = pytest.importorskip("flashbridge.torch_api.attention")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ------------------------------------------------------------------------------------------ case helpers

def make_inputs(seed, *, b=2, sq=17, sk=17, hq=2, hkv=2, dqk=32, dv=None, dtype="float32", seqlens=None,
                alibi=None, sinks=False):
    """Fresh random inputs (never zeros). ``seqlens``: list of (len_q, len_k) -> packed varlen inputs."""
    g = torch.Generator().manual_seed(seed)
    dv = dv or dqk
    dt = TORCH_DTYPES[dtype]
    kw = {}
    if seqlens is not None:
        lq = [a for a, _ in seqlens]
        lk = [c for _, c in seqlens]
        shapes = ((sum(lq), hq, dqk), (sum(lk), hkv, dqk), (sum(lk), hkv, dv))
        kw["cu_seqlens_q"] = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32)
        kw["cu_seqlens_k"] = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32)
        kw["max_seqlen_q"], kw["max_seqlen_k"] = max(lq), max(lk)
        b = len(seqlens)
    else:
        shapes = ((b, sq, hq, dqk), (b, sk, hkv, dqk), (b, sk, hkv, dv))
    q, k, v = (torch.randn(s, generator=g).to(dt) for s in shapes)
    kw.update(score_mod_inputs(g, b, hq, alibi=alibi, sinks=sinks, slope_range=0.5))
    return q, k, v, kw


def ref_options(kw, **options):
    """Options for the numpy reference (tensors -> numpy)."""
    out = dict(options)
    for name, val in kw.items():
        out[name] = val.detach().numpy() if isinstance(val, torch.Tensor) else val
    return out


def check_forward_backward(q, k, v, kw, options, *, dlse=False, floor=1e-5):
    """Run flashbridge (torch) forward + backward and compare everything with the float64 reference."""
    leaves = [q, k, v] + ([kw["sinks"]] if "sinks" in kw else [])
    for t in leaves:
        t.requires_grad_(True)
    out, lse = torch_api.flash_attention(q, k, v, **kw, **options, return_lse=True)
    ro, rl = ref.flash_attention(np64(q), np64(k), np64(v), **ref_options(kw, **options))
    n_out, n_lse = naive_torch(q.detach(), k.detach(), v.detach(), **kw, **options)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ro, n_out, name="out", floor=floor)
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(np64(lse)), finite), "lse: -inf pattern differs from the reference"
    assert_close(np.where(finite, np64(lse), 0.0), np.where(finite, rl, 0.0),
                 np.where(finite, np64(n_lse), 0.0), name="lse", floor=floor)

    g = torch.Generator().manual_seed(123)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dl = torch.randn(lse.shape, generator=g) if dlse else None
    loss = (out * dout).sum() + ((torch.where(lse.isfinite(), lse, 0.0) * dl).sum() if dlse else 0.0)
    grads = torch.autograd.grad(loss, leaves)
    rgrads = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), **ref_options(kw, **options),
                                     dlse=None if dl is None else dl.numpy())
    # naive gradients, in the inputs' dtype
    nleaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    nkw = dict(kw)
    if "sinks" in kw:
        nkw["sinks"] = nleaves[3]
    n_out, n_lse = naive_torch(*nleaves[:3], **nkw, **options)
    nloss = (n_out * dout).sum() + ((torch.where(n_lse.isfinite(), n_lse, 0.0) * dl).sum() if dlse else 0.0)
    ngrads = torch.autograd.grad(nloss, nleaves)
    for name, got, want, naive in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, ngrads):
        assert got.shape == naive.shape, f"{name}: shape {tuple(got.shape)}"
        assert_close(got, want, naive, name=name, floor=floor)
    return out, lse, grads


# ----------------------------------------------------------------------------------------------- reference

def _fd_check(seed, **spec):
    rng = np.random.default_rng(seed)
    options = spec.pop("options")
    q, k, v, kw = make_inputs(seed, dtype="float32", **spec)
    q, k, v = np64(q), np64(k), np64(v)
    kw = ref_options(kw)
    sinks = kw.pop("sinks", None)
    slopes = kw.pop("alibi_slopes", None)
    out, lse = ref.flash_attention(q, k, v, sinks=sinks, alibi_slopes=slopes, **kw, **options)
    dout = rng.standard_normal(out.shape)
    dlse = rng.standard_normal(lse.shape)
    finite = np.isfinite(lse)

    def loss(q_, k_, v_, s_, a_):
        o, l_ = ref.flash_attention(q_, k_, v_, sinks=s_, alibi_slopes=a_, **kw, **options)
        return np.sum(o * dout) + np.sum(np.where(finite, l_, 0.0) * dlse)

    grads = ref.flash_attention_bwd(dout, q, k, v, sinks=sinks, alibi_slopes=slopes, **kw, **options, dlse=dlse,
                                    return_dalibi=True)
    assert (grads[4] is None) == (slopes is None)
    args = [q, k, v, sinks, None if slopes is None else np64(slopes)]
    eps = 1e-6
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        direction = rng.standard_normal(args[i].shape)
        plus = list(args)
        minus = list(args)
        plus[i] = args[i] + eps * direction
        minus[i] = args[i] - eps * direction
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        analytic = float(np.sum(grad * direction))
        assert abs(fd - analytic) <= 1e-6 * max(1.0, abs(fd)), (i, fd, analytic)


@pytest.mark.parametrize("spec", [
    dict(sq=7, sk=9, options={}),
    dict(sq=9, sk=5, hq=4, hkv=2, dqk=8, dv=6, options=dict(causal=True, softcap=1.5)),
    dict(sq=6, sk=11, hq=2, hkv=1, dqk=4, alibi="batch", sinks=True, options=dict(window_size=(3, 1))),
    dict(sq=8, sk=4, dqk=4, sinks=True, alibi="heads", options=dict(causal=True, window_size=(1, -1))),
    dict(seqlens=[(3, 5), (6, 2), (1, 7)], hq=4, hkv=2, dqk=4, sinks=True, alibi="heads",
         options=dict(causal=True, softcap=2.0, softmax_scale=0.3)),
], ids=["dense", "causal-gqa-softcap", "window-alibi-sinks", "masked-rows", "varlen-all"])
def test_reference_backward_matches_finite_differences(spec):
    _fd_check(7, **dict(spec))


def test_reference_masking_conventions():
    # bottom-right causal: with Sq > Sk the first Sq - Sk rows see nothing: out 0, lse -inf (sink if any)
    q, k, v, kw = make_inputs(0, b=1, sq=5, sk=3, sinks=True)
    out, lse = ref.flash_attention(np64(q), np64(k), np64(v), causal=True)
    assert np.all(out[:, :2] == 0) and np.all(np.isneginf(lse[..., :2])) and np.all(np.isfinite(lse[..., 2:]))
    out, lse = ref.flash_attention(np64(q), np64(k), np64(v), causal=True, sinks=kw["sinks"].numpy())
    assert np.all(out[:, :2] == 0)
    np.testing.assert_allclose(lse[0, :, :2], np.repeat(kw["sinks"].numpy()[:, None], 2, axis=1))
    mask = ref.visible_mask(3, 5, causal=True, window_size=(1, -1))
    assert mask.tolist() == [[False, True, True, False, False], [False, False, True, True, False],
                             [False, False, False, True, True]]


# ------------------------------------------------------------------------------------- torch: accuracy

@pytest.mark.parametrize("sq,sk", [(1, 17), (17, 1), (17, 17), (63, 130), (130, 63), (130, 130)])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.thin(6)
def test_torch_odd_lengths(sq, sk, causal):
    q, k, v, kw = make_inputs(sq * 1000 + sk, b=1, sq=sq, sk=sk, dqk=40)
    check_forward_backward(q, k, v, kw, dict(causal=causal))


@pytest.mark.parametrize("dqk,dv", [(16, 16), (64, 64), (80, 80), (40, 24), (24, 72), (1, 3)])
def test_torch_head_dims(dqk, dv):
    q, k, v, kw = make_inputs(dqk * 100 + dv, sq=63, sk=17, dqk=dqk, dv=dv)
    check_forward_backward(q, k, v, kw, dict(causal=dqk % 2 == 0))


OPTION_CASES = {
    "window": (dict(sq=63, sk=130), dict(window_size=(20, 5))),
    "window-left-causal": (dict(sq=130, sk=63), dict(causal=True, window_size=(9, -1))),
    "window-right-only": (dict(sq=17, sk=63), dict(window_size=(-1, 0))),
    "gqa": (dict(hq=4, hkv=2, sq=63, sk=63), dict(causal=True)),
    "mqa": (dict(hq=3, hkv=1, sq=17, sk=63), dict()),
    "softcap": (dict(sq=63, sk=17), dict(softcap=0.7, softmax_scale=1.3)),
    # a positive scale is applied inside the exponent (kernels_common.attend_block); these take the other path
    "negative-scale": (dict(sq=63, sk=17), dict(causal=True, softmax_scale=-0.4)),
    "zero-scale": (dict(sq=17, sk=63), dict(softmax_scale=0.0)),
    "alibi-heads": (dict(sq=17, sk=63, alibi="heads"), dict(causal=True)),
    "alibi-batch": (dict(sq=63, sk=17, alibi="batch"), dict()),
    "sinks": (dict(sq=63, sk=63, sinks=True), dict()),
    "sinks-causal-masked-rows": (dict(sq=63, sk=17, sinks=True), dict(causal=True)),
    "all": (dict(hq=4, hkv=2, sq=63, sk=130, alibi="batch", sinks=True, dqk=40, dv=24),
            dict(causal=True, window_size=(30, -1), softcap=2.0)),
    "varlen": (dict(seqlens=[(17, 17), (1, 63), (63, 5), (130, 130)]), dict()),
    "varlen-causal-gqa": (dict(seqlens=[(17, 63), (63, 17), (0, 5), (5, 0)], hq=4, hkv=1), dict(causal=True)),
    "varlen-all": (dict(seqlens=[(63, 130), (17, 1), (40, 40)], hq=4, hkv=2, alibi="batch", sinks=True),
                   dict(causal=True, window_size=(16, 3), softcap=1.0)),
}


@pytest.mark.parametrize("name", list(OPTION_CASES))
@pytest.mark.thin(6)
def test_torch_options(name):
    spec, options = OPTION_CASES[name]
    q, k, v, kw = make_inputs(len(name), **spec)
    check_forward_backward(q, k, v, kw, options)


@pytest.mark.parametrize("spec,options", [(dict(sq=128, sk=192), dict(window_size=(70, 5))),
                                          (dict(sq=192, sk=128, hq=4, hkv=2), dict(causal=True, window_size=(40, -1)))],
                         ids=["window", "causal-window-gqa"])
def test_torch_windows_on_whole_blocks(spec, options):
    """Windows over lengths the interpreter's 64-wide tiles divide: the backward's window-edge blocks then
    load without bounds checks (TAIL_EDGE without TAIL_RAGGED), which the ragged cases above never reach."""
    q, k, v, kw = make_inputs(11, **spec)
    check_forward_backward(q, k, v, kw, options)


def test_torch_lse_gradient():
    q, k, v, kw = make_inputs(3, hq=4, hkv=2, sq=63, sk=17, sinks=True)
    check_forward_backward(q, k, v, kw, dict(causal=True), dlse=True)


def test_torch_fully_masked_rows_are_zero_and_neg_inf():
    # causal with Sq > Sk: the first Sq - Sk rows see no key; window (0, 0) with Sq < Sk shifts the diagonal
    q, k, v, kw = make_inputs(5, sq=63, sk=17)
    out, lse, grads = check_forward_backward(q, k, v, kw, dict(causal=True))
    assert torch.all(out[:, :46] == 0) and torch.all(lse[..., :46] == float("-inf"))
    assert torch.all(grads[0][:, :46] == 0)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_low_precision(dtype):
    q, k, v, kw = make_inputs(11, hq=4, hkv=2, sq=63, sk=130, dqk=64, dtype=dtype, sinks=True)
    check_forward_backward(q, k, v, kw, dict(causal=True, softcap=3.0))


def test_torch_strided_inputs():
    # BHSD tensors seen through a transpose, and a packed qkv projection: no copies needed on CUDA; the
    # results must match the contiguous ones exactly.
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 17, 3, 4, 32, generator=g)
    q, k, v = qkv.unbind(2)
    out = torch_api.flash_attention(q, k, v, causal=True)
    expect = torch_api.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, expect)


def test_torch_backward_is_deterministic():
    q, k, v, kw = make_inputs(9, hq=4, hkv=1, sq=130, sk=63, sinks=True)
    leaves = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), kw["sinks"].requires_grad_()]
    dout = torch.randn(2, 130, 4, 32)
    runs = []
    for _ in range(2):
        out = torch_api.flash_attention(q, k, v, causal=True, **kw)
        runs.append(torch.autograd.grad((out * dout).sum(), leaves))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ torch: integration

def test_torch_compile_fullgraph():
    q, k, v, kw = make_inputs(2, hq=4, hkv=2, sq=17, sk=33, sinks=True)
    for t in (q, k, v, kw["sinks"]):
        t.requires_grad_(True)

    def f(q, k, v, sinks):
        out, lse = torch_api.flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
        return out.float().square().sum() + lse.sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, kw["sinks"])
    grads = torch.autograd.grad(loss, (q, k, v, kw["sinks"]))
    eager_loss = f(q, k, v, kw["sinks"])
    eager = torch.autograd.grad(eager_loss, (q, k, v, kw["sinks"]))
    assert torch.equal(loss, eager_loss)
    for a, b in zip(grads, eager):
        assert torch.equal(a, b)


def test_torch_opcheck():
    q, k, v, kw = make_inputs(4, hq=2, hkv=1, sq=9, sk=17, dqk=16, sinks=True, alibi="heads")
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    kw["sinks"].requires_grad_(True)
    kw["alibi_slopes"].requires_grad_(True)
    args = (q, k, v, kw["alibi_slopes"], kw["sinks"], None, None, None, None, 0.25, True, 4, 0, 0.0)
    torch.library.opcheck(torch.ops.flashbridge.flash_attn_fwd.default, args)
    out, lse = torch.ops.flashbridge.flash_attn_fwd(*args)
    for alibi_grad in (False, True):
        bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                    torch.randn_like(lse), kw["alibi_slopes"].detach(), kw["sinks"].detach(), None, None, None, None,
                    0.25, True, 4, 0, 0.0, alibi_grad)
        torch.library.opcheck(torch.ops.flashbridge.flash_attn_bwd.default, bwd_args)


# ----------------------------------------------------------------------------------- torch: bad inputs

def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


BAD_INPUTS = [
    ("batch", dict(q=_t(2, 5, 2, 8), k=_t(3, 5, 2, 8), v=_t(3, 5, 2, 8)), ValueError, "batch"),
    ("kv length", dict(k=_t(2, 6, 2, 8)), ValueError, "k, v"),
    ("kv heads", dict(v=_t(2, 5, 1, 8)), ValueError, "k, v"),
    ("head dim", dict(k=_t(2, 5, 2, 7)), ValueError, "head dims differ"),
    ("gqa ratio", dict(q=_t(2, 5, 3, 8)), ValueError, "multiple"),
    ("head dim > 256", dict(q=_t(1, 2, 1, 257), k=_t(1, 2, 1, 257), v=_t(1, 2, 1, 8)), ValueError, "257"),
    ("dv > 256", dict(v=_t(2, 5, 2, 300)), ValueError, "300"),
    ("int dtype", dict(q=torch.ones(2, 5, 2, 8, dtype=torch.int32)), TypeError, "q: dtype int32"),
    ("float64", dict(q=_t(2, 5, 2, 8, dtype=torch.float64)), TypeError, "float64"),
    ("mixed dtypes", dict(k=_t(2, 5, 2, 8, dtype=torch.float16)), TypeError, "share one dtype"),
    ("3-D without cu_seqlens", dict(q=_t(5, 2, 8)), ValueError, "4 dimensions"),
    ("window < -1", dict(window_size=(-2, 0)), ValueError, "window_size"),
    ("window not a pair", dict(window_size=3), ValueError, "window_size"),
    ("softcap < 0", dict(softcap=-1.0), ValueError, "softcap"),
    ("sinks shape", dict(sinks=_t(3)), ValueError, "sinks"),
    ("sinks dtype", dict(sinks=torch.ones(2, dtype=torch.int32)), TypeError, "sinks"),
    ("slopes shape", dict(alibi_slopes=_t(2, 3)), ValueError, "alibi_slopes"),
    ("slopes 3-D", dict(alibi_slopes=_t(2, 2, 1)), ValueError, "alibi_slopes"),
    ("max_seqlen without cu", dict(max_seqlen_q=5), ValueError, "max_seqlen_q"),
    ("not a tensor", dict(q=np.ones((2, 5, 2, 8), np.float32)), TypeError, "q: expected a torch.Tensor"),
    ("scale nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("empty", dict(q=_t(2, 0, 2, 8)), ValueError, "empty"),
]


def test_sequence_length_bound():
    """Positions are compared in int32 with an unbounded window side standing for 2**30 (``visible``): longer
    sequences are refused from their shapes, before anything is allocated or launched."""
    from flashbridge.core_kernels.flash_attn.plan import MAX_SEQLEN, check_attention_args
    fine = ((1, MAX_SEQLEN, 1, 8), "bfloat16")
    shape, _ = check_attention_args(q=fine, k=fine, v=fine, window_size=(16, -1))
    assert shape.seqlen_q == shape.seqlen_k == MAX_SEQLEN
    long = ((1, MAX_SEQLEN + 1, 1, 8), "bfloat16")
    with pytest.raises(ValueError, match="k: sequence length 1073741824 is above"):
        check_attention_args(q=fine, k=long, v=long)
    with pytest.raises(ValueError, match="q: sequence length 1073741824 is above"):
        check_attention_args(q=long, k=fine, v=fine, causal=True)


@pytest.mark.parametrize("name,override,error,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_torch_bad_inputs(name, override, error, match):
    args = dict(q=_t(2, 5, 2, 8), k=_t(2, 5, 2, 8), v=_t(2, 5, 2, 8))
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=match):
        torch_api.flash_attention(q, k, v, **args)


def _packed(**override):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    args = dict(q=_t(8, 2, 8), k=_t(8, 2, 8), v=_t(8, 2, 8), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5,
                max_seqlen_k=5)
    args.update(override)
    return args


BAD_VARLEN = [
    ("cu int64", dict(cu_seqlens_q=torch.tensor([0, 3, 8])), TypeError, "cu_seqlens_q: must be int32"),
    ("only one cu", dict(cu_seqlens_k=None), ValueError, "give both"),
    ("cu lengths differ", dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32)), ValueError,
     "same length"),
    ("not monotone", dict(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=torch.int32)), ValueError,
     "non-decreasing"),
    ("not starting at 0", dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError,
     "start at 0"),
    ("end != packed length", dict(cu_seqlens_k=torch.tensor([0, 3, 7], dtype=torch.int32)), ValueError,
     "packed length"),
    ("max_seqlen too small", dict(max_seqlen_q=4), ValueError, "max_seqlen_q"),
    ("max_seqlen missing", dict(max_seqlen_k=None), ValueError, "max_seqlen_k"),
    ("max_seqlen beyond 2**30 - 1", dict(max_seqlen_k=2**30), ValueError, "max_seqlen_k: 1073741824 is above"),
    ("dense with cu", dict(q=_t(1, 8, 2, 8)), ValueError, "3 dimensions"),
    ("slopes batch", dict(alibi_slopes=_t(3, 2)), ValueError, "alibi_slopes"),
]


@pytest.mark.parametrize("name,override,error,match", BAD_VARLEN, ids=[c[0] for c in BAD_VARLEN])
def test_torch_bad_varlen_inputs(name, override, error, match):
    args = _packed(**override)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=match):
        torch_api.flash_attention(q, k, v, **args)


# --------------------------------------------------------------------------------------- torch drop-ins

@pytest.mark.parametrize("case", [
    dict(q=(2, 4, 17, 32), k=(2, 4, 17, 32), v=(2, 4, 17, 32), is_causal=True),
    dict(q=(2, 4, 17, 32), k=(2, 2, 40, 32), v=(2, 2, 40, 16), is_causal=True, enable_gqa=True, scale=0.3),
    dict(q=(2, 2, 40, 16), k=(2, 2, 17, 16), v=(2, 2, 17, 16), is_causal=True),
    dict(q=(3, 17, 24), k=(3, 9, 24), v=(3, 9, 8)),
    dict(q=(2, 3, 2, 9, 16), k=(2, 3, 2, 9, 16), v=(2, 3, 2, 9, 16), is_causal=True),
], ids=["causal", "gqa-top-left", "sq>sk-top-left", "3d", "5d"])
def test_sdpa_drop_in_matches_torch(case):
    case = dict(case)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(case.pop(n), generator=g, requires_grad=True) for n in "qkv")
    out = torch_api.scaled_dot_product_attention(q, k, v, **case)
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, **case)
    assert out.shape == expect.shape
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=1e-5)
    dout = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(expect, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=5e-6, rtol=1e-5)


def test_local_mask_mode():
    from flashbridge.core_kernels.flash_attn.plan import local_mask_mode
    for one in (True, False):
        assert local_mask_mode(None, None, one_comparison=one) == 0
        assert local_mask_mode(None, 2, one_comparison=one) == 2  # keys past the sequence must be masked too
        assert local_mask_mode(5, 0, one_comparison=one) == 2
        assert local_mask_mode(5, None, one_comparison=one) == 2
    assert local_mask_mode(None, 0, one_comparison=True) == 1  # causal: one comparison per score
    assert local_mask_mode(None, -3, one_comparison=True) == 1
    assert local_mask_mode(None, 0, one_comparison=False) == 2


@pytest.mark.parametrize("spec", [dict(sq=130, sk=63), dict(sq=63, sk=130, hq=4, hkv=2), dict(sq=17, sk=17),
                                  dict(seqlens=[(17, 63), (63, 17), (0, 5), (130, 130)], hq=4, hkv=1)])
@pytest.mark.thin(2)
def test_causal_mask_needs_no_bound_check(spec):
    """Causal calls mask with one comparison per score (HAS_LOCAL = 1, keys past the sequence excluded by
    the diagonal alone); a left window wider than any sequence takes the general three-comparison mask:
    forward and backward must agree bitwise, ragged and fully masked rows included."""
    q, k, v, kw = make_inputs(3, **spec)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(4))
    results = []
    for window in ((-1, -1), (10**6, -1)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = torch_api.flash_attention(*leaves, causal=True, window_size=window, **kw, return_lse=True)
        results.append((out, lse, *torch.autograd.grad(out, leaves, dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_sdpa_drop_in_rejects_masks_and_bad_dropout():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attn_mask"):
        torch_api.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p"):
        torch_api.scaled_dot_product_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="enable_gqa"):
        torch_api.scaled_dot_product_attention(q, q[:, :1], q[:, :1])


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "cross-kdim", "causal-mask", "is-causal", "unbatched"])
@pytest.mark.thin(4)
def test_multihead_attention_drop_in(batch_first, kind):
    torch.manual_seed(0)
    kdim = vdim = None
    if kind == "cross-kdim":
        kdim, vdim = 12, 20
    theirs = torch.nn.MultiheadAttention(32, 4, kdim=kdim, vdim=vdim, batch_first=batch_first)
    ours = torch_api.MultiheadAttention(32, 4, kdim=kdim, vdim=vdim, batch_first=batch_first)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    n, lq, lk = 2, 9, 13
    shape = (lambda l, e: (n, l, e)) if batch_first else (lambda l, e: (l, n, e))
    if kind == "unbatched":
        shape = lambda l, e: (l, e)  # noqa: E731
    query = torch.randn(shape(lq, 32), requires_grad=True)
    key = torch.randn(shape(lk if kind == "cross-kdim" else lq, kdim or 32))
    value = torch.randn(shape(lk if kind == "cross-kdim" else lq, vdim or 32))
    if kind in ("self", "causal-mask", "is-causal", "unbatched"):
        key = value = query
    kwargs = {}
    if kind in ("causal-mask", "is-causal"):
        kwargs["attn_mask"] = torch.nn.Transformer.generate_square_subsequent_mask(lq)
        if kind == "is-causal":
            kwargs["is_causal"] = True
    out, w = ours(query, key, value, **kwargs)
    expect, w_expect = theirs(query, key, value, **kwargs)
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(w, w_expect, atol=2e-6, rtol=1e-5)
    g_ours = torch.autograd.grad(out.sum(), [query, *ours.parameters()])
    g_theirs = torch.autograd.grad(expect.sum(), [query, *theirs.parameters()])
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    out_fast, none = ours(query, key, value, need_weights=False, **kwargs)
    assert none is None and torch.equal(out_fast, out)


def test_multihead_attention_rejects_unsupported_masks():
    mha = torch_api.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.bool).fill_diagonal_(True))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="dropout_p"):
        torch_api.MultiheadAttention(16, 2, dropout=1.0, batch_first=True).train()(x, x, x)
    with pytest.raises(ValueError, match="add_bias_kv"):
        torch_api.MultiheadAttention(16, 2, add_bias_kv=True)


# ------------------------------------------------------------------------------------------------- JAX

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _jax_api():
    from flashbridge.jax_api import attention as jax_attention
    return jax_attention




JAX_CASES = {
    "causal-gqa-sinks": (dict(hq=4, hkv=2, sq=63, sk=17, sinks=True), dict(causal=True)),
    "window-alibi-softcap": (dict(sq=17, sk=63, alibi="batch", dqk=40, dv=24),
                             dict(window_size=(8, 2), softcap=1.5)),
    "varlen-all": (dict(seqlens=[(17, 63), (40, 5)], hq=4, hkv=1, alibi="heads", sinks=True),
                   dict(causal=True, window_size=(20, -1))),
    "window-whole-blocks": (dict(sq=128, sk=192), dict(causal=True, window_size=(70, -1))),
}


@pytest.mark.parametrize("name", list(JAX_CASES))
def test_jax_forward_backward_matches_reference(name):
    ja = _jax_api()
    spec, options = JAX_CASES[name]
    q, k, v, kw = make_inputs(len(name), **spec)
    jkw = {n: torch_to_jax(a) for n, a in kw.items()}
    sinks = jkw.pop("sinks", None)

    def loss(q, k, v, sinks, dout, dlse):
        out, lse = ja.flash_attention(q, k, v, sinks=sinks, **jkw, **options, return_lse=True)
        return jnp.sum(out * dout) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse), (out, lse)

    ro, rl = ref.flash_attention(np64(q), np64(k), np64(v), **ref_options(kw, **options))
    rng = np.random.default_rng(0)
    dout, dlse = rng.standard_normal(ro.shape).astype(np.float32), rng.standard_normal(rl.shape).astype(np.float32)
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(
        torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), sinks, dout, dlse)
    n_out, _ = naive_torch(q, k, v, **kw, **options)
    assert_close(out, ro, n_out, name="out")
    rgrads = ref.flash_attention_bwd(dout, np64(q), np64(k), np64(v), **ref_options(kw, **options), dlse=dlse)
    for name_, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        # the torch suite checks the naive bound; here the same kernels must land within float32 noise
        np.testing.assert_allclose(np64(got), want, atol=2e-5 * max(1.0, np.abs(want).max()), err_msg=name_)


def test_cross_framework_parity_is_bitwise():
    ja = _jax_api()
    for dtype in ("float32", "bfloat16"):
        q, k, v, kw = make_inputs(17, hq=4, hkv=2, sq=63, sk=40, alibi="batch", sinks=True, dtype=dtype)
        options = dict(causal=True, window_size=(30, -1), softcap=2.0)
        leaves = [t.requires_grad_(True) for t in (q, k, v, kw["sinks"])]
        out, lse = torch_api.flash_attention(q, k, v, **kw, **options, return_lse=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
        tgrads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
        jkw = {n: torch_to_jax(a.detach()) for n, a in kw.items()}
        sinks = jkw.pop("sinks")
        (jout, jlse), vjp = jax.vjp(lambda q, k, v, s: ja.flash_attention(q, k, v, sinks=s, **jkw, **options,
                                                                            return_lse=True),
                                    *[torch_to_jax(t.detach()) for t in (q, k, v)], sinks)
        jgrads = vjp((torch_to_jax(dout), jnp.zeros_like(jlse)))
        np.testing.assert_array_equal(np64(jout), np64(out))
        np.testing.assert_array_equal(np64(jlse), np64(lse))
        for a, b in zip(jgrads, tgrads):
            np.testing.assert_array_equal(np64(a), np64(b))


def test_jax_vmap_folds_and_maps():
    ja = _jax_api()
    q, k, v, kw = make_inputs(21, b=2, hq=4, hkv=2, sq=17, sk=33, sinks=True, alibi="heads")
    q, k, v, sinks, slopes = (torch_to_jax(t) for t in (q, k, v, kw["sinks"], kw["alibi_slopes"]))
    qs, ks, vs = (jnp.stack([x, x * 0.5 + 0.1]) for x in (q, k, v))  # a mapped axis of 2

    def loss(q, k, v, s, a):
        return jnp.sum(jnp.sin(ja.flash_attention(q, k, v, causal=True, sinks=s, alibi_slopes=a)))

    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    # folded path: sinks and slopes shared
    batched = jax.vmap(grad, in_axes=(0, 0, 0, None, None))(qs, ks, vs, sinks, slopes)
    for i in range(2):
        single = grad(qs[i], ks[i], vs[i], sinks, slopes)
        for a, b in zip(batched[:3], single[:3]):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), atol=1e-6)
        np.testing.assert_allclose(np.asarray(batched[3][i]), np.asarray(single[3]), atol=1e-5)
    # mapped path: per-example sinks and slopes
    ss, aa = jnp.stack([sinks, sinks + 1.0]), jnp.stack([slopes, slopes * 2.0])
    batched = jax.vmap(grad)(qs, ks, vs, ss, aa)
    for i in range(2):
        single = grad(qs[i], ks[i], vs[i], ss[i], aa[i])
        for a, b in zip(batched, single):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), atol=1e-6)


def test_jax_vmap_varlen():
    ja = _jax_api()
    q, k, v, kw = make_inputs(23, seqlens=[(5, 9), (12, 3)], hq=2, hkv=1)
    jkw = {n: torch_to_jax(a) for n, a in kw.items()}
    q, k, v = (torch_to_jax(t) for t in (q, k, v))
    f = lambda q: ja.flash_attention(q, k, v, causal=True, **jkw)  # noqa: E731
    batched = jax.vmap(f)(jnp.stack([q, -q]))
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(f(-q)))


def test_jax_shard_map_over_batch_and_heads():
    ja = _jax_api()
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 host devices (XLA_FLAGS set in conftest)")
    mesh = Mesh(devices.reshape(2, 2), ("batch", "heads"))
    q, k, v, kw = make_inputs(29, b=2, hq=4, hkv=2, sq=17, sk=17, sinks=True)
    q, k, v, sinks = (torch_to_jax(t) for t in (q, k, v, kw["sinks"]))
    spec = P("batch", None, "heads", None)

    def f(q, k, v, s):
        return ja.flash_attention(q, k, v, causal=True, sinks=s)

    sharded = jax.jit(shard_map(f, mesh=mesh, in_specs=(spec, spec, spec, P("heads")), out_specs=spec))
    np.testing.assert_array_equal(np.asarray(sharded(q, k, v, sinks)), np.asarray(f(q, k, v, sinks)))

    def loss(q, k, v, s):
        return jnp.sum(sharded(q, k, v, s) ** 2)

    g_sharded = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    g_plain = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for a, b in zip(g_sharded, g_plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_jax_bad_inputs():
    ja = _jax_api()
    x = jnp.ones((2, 5, 2, 8))
    with pytest.raises(ValueError, match="multiple"):
        ja.flash_attention(jnp.ones((2, 5, 3, 8)), x, x)
    with pytest.raises(TypeError, match="share one dtype"):
        ja.flash_attention(x, x.astype(jnp.float16), x)
    with pytest.raises(ValueError, match="softcap"):
        ja.flash_attention(x, x, x, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        ja.flash_attention(x, x, x, sinks=jnp.ones(3))
    cu = jnp.array([0, 6, 5], jnp.int32)
    p = jnp.ones((5, 2, 8))
    with pytest.raises(ValueError, match="non-decreasing"):
        ja.flash_attention(p, p, p, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6, max_seqlen_k=6)
    with pytest.raises(TypeError, match="int32"):
        ja.flash_attention(p, p, p, cu_seqlens_q=cu.astype(jnp.float32), cu_seqlens_k=cu, max_seqlen_q=6,
                           max_seqlen_k=6)


@pytest.mark.parametrize("case", [
    pytest.param(dict(q=(2, 17, 4, 32), k=(2, 17, 4, 32), is_causal=True), marks=pytest.mark.slow),  # causal-window
    dict(q=(2, 17, 4, 32), k=(2, 40, 2, 32), is_causal=True, scale=0.3),
    dict(q=(2, 17, 4, 16), k=(2, 40, 2, 16), local_window_size=(5, 2)),
    dict(q=(2, 33, 2, 16), k=(2, 33, 2, 16), is_causal=True, local_window_size=7),
    dict(q=(17, 4, 16), k=(23, 4, 16)),
], ids=["causal", "gqa-top-left", "window", "causal-window", "unbatched"])
@pytest.mark.thin(2)
def test_jax_dot_product_attention_drop_in(case):
    ja = _jax_api()
    case = dict(case)
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal(case.pop("q")), jnp.float32)
    k = jnp.asarray(rng.standard_normal(case.pop("k")), jnp.float32)
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    ours = ja.dot_product_attention(q, k, v, **case)
    theirs = jax.nn.dot_product_attention(q, k, v, **case)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=2e-6, rtol=1e-5)
    def grads(f):
        return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, **case))), argnums=(0, 1, 2))(q, k, v)

    for a, b in zip(grads(ja.dot_product_attention), grads(jax.nn.dot_product_attention)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    out, res = ja.dot_product_attention(q, k, v, **case, return_residual=True)
    _, res_expect = jax.nn.dot_product_attention(q, k, v, **case, return_residual=True)
    assert res.shape == res_expect.shape == q.shape[:-1] and res.dtype == res_expect.dtype
    np.testing.assert_allclose(np.asarray(res), np.asarray(res_expect), atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="mask"):
        ja.dot_product_attention(q, k, v, mask=jnp.ones((1,), bool))


@pytest.mark.parametrize("mode", ["plain", "is_causal", "causal-mask", "gqa"])
def test_flax_multihead_attention_drop_in(mode):
    from flax import nnx
    from flashbridge.jax_api.attention_flax import MultiHeadAttention
    kwargs = dict(num_heads=4, in_features=32, qkv_features=48, out_features=24)
    if mode == "gqa":
        kwargs["num_kv_heads"] = 2
    theirs = nnx.MultiHeadAttention(**kwargs, decode=False, rngs=nnx.Rngs(0))
    ours = MultiHeadAttention(**kwargs, rngs=nnx.Rngs(1))
    assert sorted(k for k, _ in nnx.to_flat_state(nnx.state(ours))) == \
        sorted(k for k, _ in nnx.to_flat_state(nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))
    x = jax.random.normal(jax.random.key(0), (2, 9, 32))
    call = {}
    if mode == "is_causal":
        call["is_causal"] = True
    if mode == "causal-mask":
        call["mask"] = nnx.make_causal_mask(jnp.ones((2, 9)))
    np.testing.assert_allclose(np.asarray(ours(x, **call)), np.asarray(theirs(x, **call)), atol=2e-6, rtol=1e-5)
    if mode == "plain":
        with pytest.raises(ValueError, match="mask"):
            ours(x, mask=jnp.ones((2, 1, 9, 9), bool).at[..., 0].set(False))


def test_attention_config_rejects_bad_values():
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    with pytest.raises(ValueError, match="AttentionConfig.block_m"):
        AttentionConfig(block_m=48)
    with pytest.raises(ValueError, match="AttentionConfig.masked_num_stages"):
        AttentionConfig(masked_num_stages=0)
    assert AttentionConfig(masked_num_stages=1).masked_num_stages == 1
    with pytest.raises(ValueError, match="AttentionConfig.head_group"):
        AttentionConfig(head_group=0)
    with pytest.raises(ValueError, match="AttentionConfig.fused_backward"):
        AttentionConfig(fused_backward="no")  # a truthy string must not switch the one launch on
    with pytest.raises(ValueError, match="AttentionConfig.fused_backward"):
        AttentionConfig(fused_backward=0)  # nor a 0 that is not False
    with pytest.raises(ValueError, match="AttentionConfig.early_dp"):
        AttentionConfig(early_dp="yes")
    with pytest.raises(ValueError, match="AttentionConfig.interleave_backward"):
        AttentionConfig(interleave_backward=1)


@pytest.mark.parametrize("case", [
    dict(b=2, sq=130, sk=130, hq=4, hkv=2, causal=True),
    dict(b=2, sq=63, sk=130, hq=2, hkv=1, causal=True, window_size=(40, 7)),
    dict(b=1, sq=130, sk=17, hq=2, hkv=2, causal=True, softcap=5.0, alibi=True, sinks=True),
    dict(seqlens=[(5, 5), (130, 130), (63, 90)], hq=4, hkv=2, causal=True),
], ids=["causal", "window", "sq>sk-mods", "varlen"])
@pytest.mark.parametrize("masked_block_n", [16, pytest.param(32, marks=pytest.mark.slow)])
@pytest.mark.thin(2)
def test_masked_block_n_matches_the_reference(case, masked_block_n):
    """AttentionConfig.masked_block_n: the forward's masked segments (causal diagonal, both window edges,
    ragged tails, rows that see nothing) walk their keys in narrower blocks than the visible segment's (the
    interpreter's 64): out and lse against the float64 reference, through the torch and the JAX runtime."""
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    case = dict(case)
    spec = {n: case.pop(n) for n in ("b", "sq", "sk", "seqlens", "alibi", "sinks") if n in case}
    q, k, v, kw = make_inputs(masked_block_n, hq=case.pop("hq"), hkv=case.pop("hkv"), **spec)
    plan, runs = forward_with_config(q, k, v, kw, case, AttentionConfig(masked_block_n=masked_block_n))
    assert plan.launches[0].constexpr_dict()["MASKED_BLOCK_N"] == masked_block_n
    ro, rl = ref.flash_attention(np64(q), np64(k), np64(v), **ref_options(kw, **case))
    n_out, n_lse = naive_torch(q, k, v, **kw, **case)
    finite = np.isfinite(rl)
    for name, (out, lse) in runs.items():
        lse = np64(lse)
        assert_close(np64(out), ro, n_out, name=f"{name} out")
        assert np.array_equal(np.isfinite(lse), finite), f"{name} lse: -inf pattern differs from the reference"
        assert_close(np.where(finite, lse, 0.0), np.where(finite, rl, 0.0), np.where(finite, np64(n_lse), 0.0),
                     name=f"{name} lse")


def test_masked_block_n_defaults():
    """None (the default): 64 for D=128's causal / windowed forward on a GPU (the H200 A/B), the forward's
    block_n for the full forward and on the interpreter (the kernel the option did not exist for); any width
    >= block_n gives block_n. Not a power of two: an error naming the field."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig, check_attention_args, plan_attention_fwd

    info = ((2, 2048, 4, 128), "bfloat16")  # keys up to 1k have a swept tile of their own (docs/tiles.md)
    gpu = Target(interpret=False, num_sms=132)

    def widths(config, target=gpu, **kw):
        shape, options = check_attention_args(q=info, k=info, v=info, **kw)
        c = plan_attention_fwd(shape, options, target=target, config=config).launches[0].constexpr_dict()
        return c["BLOCK_N"], c["MASKED_BLOCK_N"]

    assert widths(AttentionConfig(), causal=True) == (128, 64)
    assert widths(AttentionConfig(), window_size=(256, 0)) == (128, 64)
    assert widths(AttentionConfig(), causal=False) == (128, 128)
    assert widths(AttentionConfig(), Target(interpret=True, num_sms=1), causal=True) == (64, 64)
    assert widths(AttentionConfig(masked_block_n=256), causal=True) == (128, 128)
    assert widths(AttentionConfig(masked_block_n=128), causal=True) == (128, 128)
    assert widths(AttentionConfig(masked_block_n=32), causal=False) == (128, 32)
    with pytest.raises(ValueError, match="AttentionConfig.masked_block_n"):
        AttentionConfig(masked_block_n=48)


def test_head_group_default_is_4_for_causal_attention_on_a_gpu():
    """The program order of every main kernel (forward, dK/dV, dQ): longest-first over 4 heads for causal
    attention on a GPU (the H200 order sweep), grid order for full attention and on the interpreter, and an
    explicit AttentionConfig.head_group wins."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)

    info = ((2, 256, 4, 128), "bfloat16")

    def groups(causal, target, config=AttentionConfig()):
        shape, options = check_attention_args(q=info, k=info, v=info, causal=causal)
        plans = (plan_attention_fwd(shape, options, target=target, config=config),
                 plan_attention_bwd(shape, options, target=target, config=config))
        return {dict(launch.constexprs).get("HEAD_GROUP") for plan in plans for launch in plan.launches} - {None}

    gpu, cpu = Target(interpret=False, num_sms=132), Target(interpret=True, num_sms=4)
    assert groups(True, gpu) == {4} and groups(False, gpu) == {1} and groups(True, cpu) == {1}
    assert groups(True, gpu, AttentionConfig(head_group=1)) == {1}


def test_gqa_causal_backward_takes_its_dkdv_tile():
    """On a GPU, D=128: causal GQA backward takes the H200's causal GQA dK/dV tile (32 query rows per step:
    each dK/dV program walks group x Sq rows); MHA and full GQA keep 64; D=64 keeps its 64;
    AttentionConfig.dkdv_* still wins; the interpreter keeps its one tile."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import (INTERPRETER_TILE, AttentionConfig, check_attention_args,
                                                          plan_attention_bwd)

    gpu, cpu = Target(interpret=False, num_sms=132), Target(interpret=True, num_sms=4)

    def dkdv_block_m(hkv, causal, d=128, target=gpu, config=AttentionConfig()):
        shape, options = check_attention_args(q=((2, 512, 8, d), "bfloat16"), k=((2, 512, hkv, d), "bfloat16"),
                                              v=((2, 512, hkv, d), "bfloat16"), causal=causal)
        launch = plan_attention_bwd(shape, options, target=target, config=config).launches[1]
        return dict(launch.constexprs)["KV_BLOCK_M"]

    assert dkdv_block_m(2, True) == 32
    assert dkdv_block_m(8, True) == dkdv_block_m(2, False) == 64
    assert dkdv_block_m(2, True, d=64) == 64
    assert dkdv_block_m(2, True, config=AttentionConfig(dkdv_block_m=64)) == 64
    assert dkdv_block_m(2, True, target=cpu) == INTERPRETER_TILE[0]


def test_jax_fused_backward_gives_identical_results():
    """The one-launch backward through the JAX runtime (three outputs of one kernel), in either program
    order: bitwise the two kernels' dq, dk, dv, causal GQA with a ragged tail."""
    import jax.numpy as jnp

    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)
    from flashbridge.jax_api._runtime import execute

    g = np.random.default_rng(7)
    q, dout = (jnp.asarray(g.standard_normal((2, 70, 4, 32)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(g.standard_normal((2, 70, 2, 32)), jnp.float32) for _ in range(2))
    info_q, info_kv = ((2, 70, 4, 32), "float32"), ((2, 70, 2, 32), "float32")
    shape, options = check_attention_args(q=info_q, k=info_kv, v=info_kv, causal=True)
    out, lse = execute(lambda t: plan_attention_fwd(shape, options, target=t), {"q": q, "k": k, "v": v})
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}

    def grads(config):
        return execute(lambda t: plan_attention_bwd(shape, options, target=t, config=config), inputs)

    want = grads(AttentionConfig(fused_backward=False))
    for config in (AttentionConfig(fused_backward=True), AttentionConfig(fused_backward=True, interleave_backward=True)):
        for got, ref in zip(grads(config), want):
            assert bool(jnp.all(jnp.isfinite(got))) and bool(jnp.array_equal(got, ref)), config


def test_early_dp_defaults():
    """EARLY_DP of the default GPU plans follows GPU_EARLY_DP (D=128 always, D=64 without a causal mask or
    window, D=256 without a causal mask, float32 never); the interpreter keeps the default order; the config
    overrides."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig, check_attention_args, plan_attention_bwd

    gpu, cpu = Target(interpret=False, num_sms=132), Target(interpret=True, num_sms=4)

    def early(d, causal=False, window=(-1, -1), dtype="bfloat16", target=gpu, config=AttentionConfig()):
        info = ((2, 512, 4, d), dtype)
        shape, options = check_attention_args(q=info, k=info, v=info, causal=causal, window_size=window)
        launches = plan_attention_bwd(shape, options, target=target, config=config).launches
        return {dict(launch.constexprs)["EARLY_DP"] for launch in launches if "EARLY_DP" in dict(launch.constexprs)}

    assert early(128) == early(128, causal=True) == early(96, window=(64, 64)) == {True}
    assert early(64) == {True} and early(64, causal=True) == early(48, window=(32, -1)) == {False}
    assert early(256) == {True} and early(256, causal=True) == {False}
    assert early(128, dtype="float32") == early(128, target=cpu) == {False}
    assert early(64, causal=True, config=AttentionConfig(early_dp=True)) == {True}
    assert early(128, config=AttentionConfig(early_dp=False)) == {False}


@pytest.mark.parametrize("fused", [True, False])
def test_early_dp_gives_identical_results(fused):
    """AttentionConfig.early_dp (dP^T issued before the exponentials in the dK/dV loop's unmasked segment)
    through both runtimes on the interpreter: bitwise the default order's dq, dk, dv, with softcap (the
    score gradient's tanh term) on causal GQA with a ragged tail, so the masked and the unmasked segments
    both run; the one launch and the two kernels."""
    import jax.numpy as jnp
    import torch

    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)
    from flashbridge.jax_api import _runtime as jax_runtime
    from flashbridge.torch_api import _runtime as torch_runtime

    g = np.random.default_rng(11)
    # 150 tokens: two blocks of the interpreter's 64 and a ragged third, so that key block 0 has an unmasked
    # query block (1) between its diagonal and the tail; one sequence, two query heads per key head
    q, dout = (g.standard_normal((1, 150, 2, 32)).astype(np.float32) for _ in range(2))
    k, v = (g.standard_normal((1, 150, 1, 32)).astype(np.float32) for _ in range(2))
    info_q, info_kv = ((1, 150, 2, 32), "float32"), ((1, 150, 1, 32), "float32")
    shape, options = check_attention_args(q=info_q, k=info_kv, v=info_kv, causal=True, softcap=20.0)
    cpu = torch_runtime.target_for(torch.device("cpu"))
    kernels = [launch.kernel.split(":")[1] for launch in plan_attention_bwd(
        shape, options, target=cpu, config=AttentionConfig(early_dp=True, fused_backward=fused)).launches]
    assert ("attn_bwd_kernel" in kernels) == fused and dict(
        plan_attention_bwd(shape, options, target=cpu, config=AttentionConfig(early_dp=True)).launches[1].constexprs
    )["EARLY_DP"] is True

    def grads(early):
        config = AttentionConfig(early_dp=early, fused_backward=fused)
        tq, tk, tv, tdo = (torch.from_numpy(a) for a in (q, k, v, dout))
        out, lse = torch_runtime.execute(plan_attention_fwd(shape, options, target=cpu), {"q": tq, "k": tk, "v": tv})
        by_torch = torch_runtime.execute(plan_attention_bwd(shape, options, target=cpu, config=config),
                                         {"dout": tdo, "q": tq, "k": tk, "v": tv, "out": out, "lse": lse})
        inputs = {"dout": jnp.asarray(dout), "q": jnp.asarray(q), "k": jnp.asarray(k), "v": jnp.asarray(v),
                  "out": jnp.asarray(out.numpy()), "lse": jnp.asarray(lse.numpy())}
        by_jax = jax_runtime.execute(lambda t: plan_attention_bwd(shape, options, target=t, config=config), inputs)
        return [t.numpy() for t in by_torch], [np.asarray(a) for a in by_jax]

    (torch_late, jax_late), (torch_early, jax_early) = grads(False), grads(True)
    for late, early, jax_e in zip(torch_late, torch_early, jax_early):
        assert np.isfinite(late).all() and np.abs(late).max() > 0
        np.testing.assert_array_equal(early, late)
        np.testing.assert_array_equal(jax_e, late)


def test_fused_backward_needs_one_warp_count():
    """fused_backward (default on) makes one launch of dK/dV and dQ when their tiles share num_warps (GPU
    D=128: 8 and 8) and keeps two otherwise (GPU D=256: 4 and 8), so that no path runs at another tile's warp
    count; fused_backward=False always makes two."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig, check_attention_args, plan_attention_bwd

    gpu = Target(interpret=False, num_sms=132)

    def kernels(d, **settings):
        info = ((2, 512, 4, d), "bfloat16")
        shape, options = check_attention_args(q=info, k=info, v=info, causal=True)
        plan = plan_attention_bwd(shape, options, target=gpu, config=AttentionConfig(**settings))
        return [launch.kernel.split(":")[1] for launch in plan.launches]

    assert kernels(128) == kernels(128, fused_backward=True) == ["attn_bwd_preprocess_kernel", "attn_bwd_kernel"]
    assert kernels(128, fused_backward=False) == ["attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                                                  "attn_bwd_dq_kernel"]
    assert kernels(256, fused_backward=True) == kernels(256) == kernels(256, fused_backward=False)
    assert kernels(256, fused_backward=True, dkdv_col_split=1, dq_num_warps=4)[1:] == ["attn_bwd_kernel"]
    # a split dK/dV grid (D=256's default) always runs as its own launch, whatever the warp counts
    assert kernels(256, fused_backward=True, dkdv_num_warps=8, dq_num_warps=8)[1:] == ["attn_bwd_dkdv_kernel",
                                                                                    "attn_bwd_dq_kernel"]


def test_tail_segments_left_out_only_when_provably_empty():
    """TAIL_BLOCKS: the dQ and dK/dV kernels (and the one-launch backward's halves) compile a trailing masked
    segment only where a program can have blocks there: TAIL_EDGE for a window edge after the visible blocks
    (dK/dV walks queries: a bounded left side; dQ walks keys: a bounded right side, causal included),
    TAIL_RAGGED (the only blocks whose loads are checked) for a loop axis the block does not divide or
    packed sequences. The forward always keeps its segments."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import (TAIL_EDGE, TAIL_RAGGED, AttentionConfig,
                                                          check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)

    gpu = Target(interpret=False, num_sms=132)

    def tails(s_q, s_k, config=AttentionConfig(), **options):
        info_q, info_k = ((2, s_q, 4, 128), "bfloat16"), ((2, s_k, 4, 128), "bfloat16")
        shape, opts = check_attention_args(q=info_q, k=info_k, v=info_k, **options)
        assert "TAIL_BLOCKS" not in plan_attention_fwd(shape, opts, target=gpu, config=config).launches[0].constexpr_dict()
        found = {}
        for launch in plan_attention_bwd(shape, opts, target=gpu, config=config).launches[1:]:
            c = launch.constexpr_dict()
            if "TAIL_BLOCKS" in c:  # the two-launch backward's kernels
                c = {("KV_" if launch.kernel.endswith("dkdv_kernel") else "Q_") + "TAIL_BLOCKS": c["TAIL_BLOCKS"]}
            found.update({k: v for k, v in c.items() if k.endswith("TAIL_BLOCKS")})
        return found["KV_TAIL_BLOCKS"], found["Q_TAIL_BLOCKS"]

    assert tails(4096, 4096) == (0, 0)
    assert tails(4096, 4096, causal=True) == (0, TAIL_EDGE)  # dK/dV: only the diagonal, which leads
    assert tails(4096, 4096, window_size=(256, 256)) == (TAIL_EDGE, TAIL_EDGE)
    assert tails(4096, 4096, window_size=(256, -1)) == (TAIL_EDGE, 0)
    assert tails(4096, 4000) == (0, TAIL_RAGGED)
    assert tails(4000, 4096, causal=True) == (TAIL_RAGGED, TAIL_EDGE)
    assert tails(4000, 4000, window_size=(100, 0)) == (TAIL_EDGE | TAIL_RAGGED, TAIL_EDGE | TAIL_RAGGED)
    two = tails(4096, 4096, AttentionConfig(fused_backward=False), window_size=(256, 0))
    assert two == (TAIL_EDGE, TAIL_EDGE)


def test_dkdv_col_split_defaults_and_errors():
    """GPU_DKDV_COL_SPLIT: D=256 (and head dims padded to it) splits dK/dV's columns over two programs per
    key block with the H200's split tile (grid axis 0 doubled); other head dims, float32 inputs and
    the interpreter keep one program; the config overrides (back to the unsplit tile); bad values and
    halves narrower than 16 columns are errors naming the field."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig, check_attention_args, plan_attention_bwd

    gpu, cpu = Target(interpret=False, num_sms=132), Target(interpret=True, num_sms=4)

    def dkdv(d, causal=False, dtype="bfloat16", target=gpu, dv=None, **settings):
        info_q, info_v = ((2, 512, 4, d), dtype), ((2, 512, 4, dv or d), dtype)
        shape, options = check_attention_args(q=info_q, k=info_q, v=info_v, causal=causal)
        launch = plan_attention_bwd(shape, options, target=target, config=AttentionConfig(**settings)).launches[1]
        c = launch.constexpr_dict()
        return c.get("COL_SPLIT"), launch.grid[0], (c.get("BLOCK_M"), c.get("BLOCK_N"), launch.num_warps,
                                                     launch.num_stages)

    split_tile, tile = (32, 128, 8, 2), (32, 32, 4, 2)  # the H200's shipped D=256 dK/dV tiles
    assert dkdv(256) == dkdv(256, causal=True) == (2, 2 * 512 // split_tile[1], split_tile)
    assert dkdv(192, dv=128, causal=True)[0] == 2
    assert dkdv(256, dkdv_col_split=1) == (1, 512 // tile[1], tile)
    assert dkdv(128)[0] is None  # the one-launch kernel: never split
    assert dkdv(256, dtype="float32")[0] == 1
    assert dkdv(256, target=cpu)[0] is None  # the interpreter's tiles share a warp count: one launch
    assert dkdv(64, target=cpu, dkdv_col_split=2)[:2] == (2, 2 * 512 // 64)
    with pytest.raises(ValueError, match="AttentionConfig.dkdv_col_split"):
        AttentionConfig(dkdv_col_split=3)
    with pytest.raises(ValueError, match="AttentionConfig.dkdv_col_split"):
        dkdv(16, target=cpu, dkdv_col_split=2)


@pytest.mark.parametrize("case", [
    dict(b=2, sq=70, sk=90, hq=4, hkv=2, dqk=32, causal=True),
    dict(b=1, sq=64, sk=130, hq=2, hkv=1, dqk=64, dv=32, softcap=5.0, alibi=True),
    pytest.param(dict(seqlens=[(5, 5), (130, 130), (63, 90)], hq=4, hkv=2, dqk=48, causal=True,
                      window_size=(40, 7), sinks=True), marks=pytest.mark.slow),
], ids=["causal-gqa", "dqk!=dv-mods", "varlen-window-padded"])
def test_dkdv_col_split_matches_the_reference(case):
    """AttentionConfig.dkdv_col_split=2 on the interpreter: dq, dk, dv (and dsinks) against the float64
    reference through the torch and the JAX runtime, on causal GQA with ragged tails, Dqk != Dv with softcap
    and ALiBi, and packed sequences with a window and a head dim padded to 64 (column halves masked); the
    split's results also agree with one program per key block to float32 rounding."""
    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)
    from flashbridge.jax_api._runtime import execute as jax_execute
    from flashbridge.torch_api._runtime import dtype_name, execute, target_for

    case = dict(case)
    spec = {n: case.pop(n) for n in ("b", "sq", "sk", "seqlens", "alibi", "sinks", "hq", "hkv", "dqk", "dv")
            if n in case}
    q, k, v, kw = make_inputs(len(str(case)), **spec)
    tensors = {n: t for n, t in kw.items() if isinstance(t, torch.Tensor)}
    infos = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in {"q": q, "k": k, "v": v, **tensors}.items()}
    sizes = {n: kw[n] for n in ("max_seqlen_q", "max_seqlen_k") if n in kw}
    shape, options = check_attention_args(**infos, **sizes, **case)
    target = target_for(q.device)
    out, lse = execute(plan_attention_fwd(shape, options, target=target), {"q": q, "k": k, "v": v, **tensors})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **tensors}
    sinks_dtype = {"sinks_dtype": "float32"} if "sinks" in kw else {}

    def plan(config):
        return lambda t: plan_attention_bwd(shape, options, target=t, config=config, **sinks_dtype)

    split, whole = AttentionConfig(dkdv_col_split=2), AttentionConfig(dkdv_col_split=1)
    assert plan(split)(target).launches[1].constexpr_dict()["COL_SPLIT"] == 2
    runs = {"torch": execute(plan(split)(target), inputs),
            "jax": jax_execute(plan(split), {n: torch_to_jax(t) for n, t in inputs.items()})}
    unsplit = execute(plan(whole)(target), inputs)
    rgrads = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), **ref_options(kw, **case))
    nleaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    nkw = dict(kw)
    if "sinks" in kw:
        nkw["sinks"] = kw["sinks"].detach().clone().requires_grad_(True)
        nleaves.append(nkw["sinks"])
    n_out, _ = naive_torch(*nleaves[:3], **nkw, **case)
    ngrads = torch.autograd.grad((n_out * dout).sum(), nleaves)
    for framework, grads in runs.items():
        for name, got, want, naive, one in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, ngrads, unsplit):
            assert_close(np64(got), want, naive, name=f"{framework} {name}")
            np.testing.assert_allclose(np64(got), np64(one), rtol=1e-5, atol=1e-5, err_msg=f"{framework} {name}")


_ORDER_CASES = [
    dict(b=2, sq=130, sk=130, hq=6, hkv=2, causal=True),
    dict(b=3, sq=17, sk=63, hq=4, hkv=4, causal=True, window_size=(20, 0)),
    dict(varlen=(5, 63, 130), hq=4, hkv=2, causal=True),
    dict(b=1, sq=64, sk=130, hq=2, hkv=1, causal=False, softcap=5.0),
    dict(b=2, sq=70, sk=90, hq=4, hkv=2, causal=True, alibi=True),
]
_ORDER_CONFIGS = [
    dict(head_group=3), dict(head_group=64), dict(), dict(fused_backward=False, head_group=3),
    dict(fused_backward=True, dkdv_block_m=16, dkdv_block_n=32, dq_block_m=32, dq_block_n=16),
]


# every config and every case once in the default run (config i with case i); the rest of the grid is slow
@pytest.mark.parametrize("case, config", [
    pytest.param(case, config, id=f"{','.join(f'{k}={v}' for k, v in config.items())}-case{i}",
                 marks=() if i == j else pytest.mark.slow)
    for j, config in enumerate(_ORDER_CONFIGS) for i, case in enumerate(_ORDER_CASES)])
@pytest.mark.thin(2)
def test_program_order_and_fused_backward_give_identical_results(case, config):
    """block_schedule's program orders (AttentionConfig.head_group) and the one-launch backward
    (fused_backward, the default: attn_bwd_kernel): every output element written (outputs are poisoned before
    each launch in tests) and bitwise the values of the grid order / the two backward kernels with the same tiles,
    forward and backward, including a group that does not divide the (head, sequence) pairs, one larger
    than all of them, and dK/dV and dQ tiles of different sizes in one launch."""
    import zlib

    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)
    from flashbridge.torch_api._runtime import execute, target_for

    case = dict(case)
    g = torch.Generator().manual_seed(zlib.crc32(f"order{case}{config}".encode()))
    hq, hkv, d = case.pop("hq"), case.pop("hkv"), 32
    lengths = case.pop("varlen", None)
    if lengths:
        tq = sum(lengths)
        shapes = ((tq, hq, d), (tq, hkv, d), (tq, hkv, d))
        cu = torch.tensor(np.cumsum((0, *lengths)), dtype=torch.int32)
        extra = dict(cu_seqlens_q=((len(lengths) + 1,), "int32"), cu_seqlens_k=((len(lengths) + 1,), "int32"),
                     max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        tensors = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    else:
        b, sq, sk = case.pop("b"), case.pop("sq"), case.pop("sk")
        shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
        extra, tensors = {}, {}
    if case.pop("alibi", False):
        tensors["alibi_slopes"] = torch.rand(hq, generator=g) + 0.1
        extra["alibi_slopes"] = ((hq,), "float32")
    q, k, v = (torch.randn(*s, generator=g) for s in shapes)
    dout = torch.randn(*q.shape, generator=g)
    shape, options = check_attention_args(q=(q.shape, "float32"), k=(k.shape, "float32"), v=(v.shape, "float32"),
                                          **extra, **case)
    target = target_for(q.device)

    def run(config):
        out, lse = execute(plan_attention_fwd(shape, options, target=target, config=config),
                           {"q": q, "k": k, "v": v, **tensors})
        grads = execute(plan_attention_bwd(shape, options, target=target, config=config),
                        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, **tensors})
        return (out, lse, *grads)

    tiles = {k: v for k, v in config.items() if "block" in k}
    fused = plan_attention_bwd(shape, options, target=target, config=AttentionConfig(**config)).launches
    assert ("attn_bwd_kernel" in fused[1].kernel) == config.get("fused_backward", True)
    for got, want in zip(run(AttentionConfig(**config)), run(AttentionConfig(**tiles, fused_backward=False))):
        assert torch.equal(got, want)  # a program skipped or run twice leaves poison (NaN) or another value
