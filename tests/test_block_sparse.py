"""Block-sparse attention on the CPU (Triton interpreter): flashbridge.masks against the definitions of its
builders, and attention with every builder against the float64 reference given the same mask densely --
forward and every gradient, both frameworks, bit-for-bit parity between them.

Shapes are tiny (the interpreter pays per program and per operation) but odd: lengths 17 / 40 / 63 / 70,
Sq != Sk, blocks of 16 and 32 and unequal sides, GQA, per-batch and per-head masks.
"""
from __future__ import annotations

import dataclasses
import doctest
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from flashbridge import masks
from flashbridge.reference import attention as ref
from helpers import assert_close, naive_masked_attention, np64, torch_to_jax

torch_api = pytest.importorskip("flashbridge.torch_api")


# ------------------------------------------------------------------------------------------ definitions

def _ij(sq, sk):
    return np.arange(sq)[:, None], np.arange(sk)[None, :]


def defined(kind, **a):
    """The dense bool mask of each builder, straight from the definitions in its docstring."""
    if kind == "causal":
        sq, sk = a["sq"], a.get("sk", a["sq"])
        i, j = _ij(sq, sk)
        return j <= i + sk - sq
    s = a.get("s")
    i, j = _ij(s, s) if s else (None, None)
    if kind == "sliding_window":
        return (j >= i - a["left"]) & (j <= i + a["right"])
    if kind == "streaming":
        return (j <= i) & ((j < a["num_sink"]) | (j >= i - a["window"]))
    if kind == "longformer":
        g = np.zeros(s, bool)
        g[list(a["global_tokens"])] = True
        return (np.abs(i - j) <= a["window"]) | g[:, None] | g[None, :]
    if kind == "document":
        doc = np.repeat(np.arange(len(a["lengths"])), a["lengths"])
        n = len(doc)
        i, j = _ij(n, n)
        same = doc[:, None] == doc[None, :]
        return same & (j <= i) if a["causal"] else same
    raise KeyError(kind)


def _check_lists(m: masks.BlockMask, dense: np.ndarray):
    """Full blocks are wholly visible and inside the sequences, unvisited blocks invisible, and the
    transposed lists hold exactly the query-major ones."""
    blocks = masks._padded_blocks(np.broadcast_to(dense, m.shape[:2] + dense.shape[-2:]), m.q_block, m.kv_block)
    status = m.status()
    assert not (blocks.any(axis=(3, 5)) & (status == masks.NONE)).any(), "a visible element in an unvisited block"
    assert not ((status == masks.FULL) & ~blocks.all(axis=(3, 5))).any(), "a full block that is not"
    transposed = np.zeros(status.shape, np.int8)
    for num, idx, value in ((m.q_num_blocks, m.q_indices, masks.PARTIAL),
                            (m.full_q_num_blocks, m.full_q_indices, masks.FULL)):
        bi, hi, ki, slot = np.nonzero(np.arange(idx.shape[-1]) < num[..., None])
        transposed[bi, hi, idx[bi, hi, ki, slot], ki] = value
    np.testing.assert_array_equal(transposed, status)
    for num, idx in ((m.kv_num_blocks, m.kv_indices), (m.full_kv_num_blocks, m.full_kv_indices)):
        rows = [idx[b, h, r, :num[b, h, r]] for b, h, r in np.ndindex(num.shape)]
        assert all((np.diff(r) > 0).all() for r in rows), "lists must ascend"
    # the program order: a permutation of the blocks, longest (most visited blocks) first
    for order, work in ((m.q_order, m.kv_num_blocks + m.full_kv_num_blocks),
                        (m.kv_order, m.q_num_blocks + m.full_q_num_blocks)):
        np.testing.assert_array_equal(np.sort(order, axis=-1), np.broadcast_to(np.arange(order.shape[-1]), order.shape))
        assert (np.diff(np.take_along_axis(work, order, -1), axis=-1) <= 0).all()


BUILDERS = [
    ("causal", dict(sq=63), dict(seq_len_q=63)),
    ("causal", dict(sq=17, sk=40), dict(seq_len_q=17, seq_len_k=40)),
    ("causal", dict(sq=40, sk=17), dict(seq_len_q=40, seq_len_k=17)),
    ("sliding_window", dict(s=63, left=10, right=3), dict(seq_len=63, left=10, right=3)),
    ("sliding_window", dict(s=70, left=0, right=0), dict(seq_len=70, left=0, right=0)),
    ("sliding_window", dict(s=40, left=7, right=-3), dict(seq_len=40, left=7, right=-3)),
    ("streaming", dict(s=63, num_sink=3, window=8), dict(seq_len=63, num_sink=3, window=8)),
    ("streaming", dict(s=70, num_sink=20, window=0), dict(seq_len=70, num_sink=20, window=0)),
    ("longformer", dict(s=63, window=5, global_tokens=[0, 40]), dict(seq_len=63, window=5, global_tokens=[0, 40])),
    ("longformer", dict(s=70, window=2, global_tokens=range(16, 32)),
     dict(seq_len=70, window=2, global_tokens=list(range(16, 32)))),
    ("document", dict(lengths=[20, 0, 30, 13], causal=True), dict(segment_lengths=[20, 0, 30, 13], causal=True)),
    ("document", dict(lengths=[17, 23], causal=False), dict(segment_lengths=[17, 23], causal=False)),
]


@pytest.mark.parametrize("block_size", [16, 32, (16, 32), (48, 16)])
@pytest.mark.parametrize("kind,definition,args", BUILDERS, ids=[f"{b[0]}-{i}" for i, b in enumerate(BUILDERS)])
def test_builder_to_dense_matches_definition(kind, definition, args, block_size):
    m = getattr(masks, kind)(**args, block_size=block_size)
    dense = defined(kind, **definition)
    assert m.shape == (1, 1, *dense.shape)
    np.testing.assert_array_equal(m.to_dense()[0, 0], dense)
    _check_lists(m, dense)


def test_document_per_batch_and_bigbird_and_from_blocks():
    m = masks.document([[10, 30], [25, 15]], causal=True, block_size=16)
    dense = np.stack([defined("document", lengths=l, causal=True) for l in ([10, 30], [25, 15])])
    np.testing.assert_array_equal(m.to_dense()[:, 0], dense)
    _check_lists(m, dense[:, None])
    # BigBird: window / global / random blocks, exactly num_random_blocks extra per row (when there is room)
    bb = masks.bigbird(200, window_blocks=1, num_global_blocks=1, num_random_blocks=2, seed=3, block_size=16)
    grid = bb.status()[0, 0] > 0
    a = np.arange(grid.shape[0])
    base = (np.abs(a[:, None] - a[None, :]) <= 1) | (a[:, None] < 1) | (a[None, :] < 1)
    assert (grid >= base).all()
    assert ((grid & ~base).sum(axis=1) == np.minimum(2, (~base).sum(axis=1))).all()
    expanded = np.repeat(np.repeat(grid, 16, 0), 16, 1)[:200, :200]
    np.testing.assert_array_equal(bb.to_dense()[0, 0], expanded)
    assert masks.bigbird(200, window_blocks=1, num_global_blocks=1, num_random_blocks=2, seed=3,
                         block_size=16).status().tobytes() == bb.status().tobytes()  # seeded
    # from_blocks: per head, Sq != Sk, ragged edges partial with the bounds only
    blocks = np.random.default_rng(0).random((2, 3, 2)) < 0.5
    fb = masks.from_blocks(blocks, seq_len_q=40, seq_len_k=17, block_size=16)
    np.testing.assert_array_equal(fb.to_dense()[0], np.repeat(np.repeat(blocks, 16, 1), 16, 2)[:, :40, :17])


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from([16, 32, (16, 48)]), st.integers(0, 2**31 - 1),
       st.floats(0.0, 1.0))
def test_from_dense_and_combinations_are_exact(sq, sk, block_size, seed, density):
    rng = np.random.default_rng(seed)
    dense = rng.random((2, 1, sq, sk)) < density
    m = masks.from_dense(dense, block_size=block_size)
    np.testing.assert_array_equal(m.to_dense(), dense)
    _check_lists(m, dense)
    c = masks.causal(sq, sk, block_size=block_size)
    blocks = masks.from_blocks(rng.random((3, *c.num_blocks)) < 0.5, seq_len_q=sq, seq_len_k=sk,
                               block_size=block_size)
    for a, b in ((c, m), (m, c), (c, blocks), (blocks, m), (c, c)):
        for got, want in ((a & b, a.to_dense() & b.to_dense()), (a | b, a.to_dense() | b.to_dense())):
            np.testing.assert_array_equal(got.to_dense(), np.broadcast_to(want, got.shape))
            _check_lists(got, np.broadcast_to(want, got.shape))
    assert (c & blocks).terms == c.terms  # an AND with a block-granular mask keeps the analytic test


def test_top_k_block_lists_of_the_mla_seed():
    """The MLA seed's block lists (S=4096, 64 queries per program, 64 keys per step): 64 key blocks per query
    block dense, 32 after top-k; the lists are head-dim agnostic and as wide as the grid for any top-k."""
    dense = masks.from_blocks(np.ones((64, 64), bool), seq_len_q=4096, seq_len_k=4096, block_size=64)
    assert (dense.full_kv_num_blocks == 64).all() and (dense.kv_num_blocks == 0).all()
    top = np.random.default_rng(0).random((64, 64)).argsort(1)[:, :32]
    blocks = np.zeros((64, 64), bool)
    np.put_along_axis(blocks, top, True, 1)
    m = masks.from_blocks(blocks, seq_len_q=4096, seq_len_k=4096, block_size=64)
    assert (m.full_kv_num_blocks == 32).all() and m.kv_indices.shape == (1, 1, 64, 64)
    np.testing.assert_array_equal(np.sort(m.full_kv_indices[0, 0, :, :32], 1), np.sort(top, 1))
    assert m.density == 0.5 and m.q_indices.shape == dense.q_indices.shape


def test_mask_properties_and_pictures():
    m = masks.causal(1000, block_size=128)
    assert m.shape == (1, 1, 1000, 1000) and m.block_size == (128, 128) and m.num_blocks == (8, 8)
    assert m.density == pytest.approx(36 / 64)
    assert "BlockMask(shape=(1, 1, 1000, 1000)" in repr(m) and "band(left=None, right=0)" in repr(m)
    rows = m.picture().splitlines()[-8:]
    assert rows[0] == "▒·······" and rows[6] == "██████▒·" and rows[7] == "▒▒▒▒▒▒▒▒"
    assert len(masks.causal(131072).picture(max_cells=32).splitlines()[-1]) == 32
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    assert m.plot() is not None


def test_masks_build_in_milliseconds_at_128k():
    s = 131072
    builders = [lambda: masks.causal(s), lambda: masks.sliding_window(s, 4096), lambda: masks.streaming(s, 4, 1024),
                lambda: masks.document(list(np.full(16, s // 16))),
                lambda: masks.longformer(s, 512, list(range(16))),
                lambda: masks.bigbird(s, window_blocks=1, num_global_blocks=2, num_random_blocks=5, seed=0)]
    for build in builders:
        start = time.perf_counter()
        build()
        assert time.perf_counter() - start < 2.0  # ~40-120 ms on a loaded 2-core machine


def test_mask_errors():
    with pytest.raises(ValueError, match="block_size"):
        masks.causal(64, block_size=24)
    with pytest.raises(ValueError, match="block_size"):
        masks.causal(64, block_size=(16, 16, 16))
    with pytest.raises(ValueError, match="seq_len_q"):
        masks.causal(0)
    with pytest.raises(ValueError, match="left, right"):
        masks.sliding_window(64, 4, -5)
    with pytest.raises(ValueError, match="segment_lengths"):
        masks.document([[10, 5], [3, 3]])
    with pytest.raises(ValueError, match="global_tokens"):
        masks.longformer(64, 4, [64])
    with pytest.raises(ValueError, match="square"):
        masks.bigbird(64, window_blocks=1, num_global_blocks=1, num_random_blocks=1, seed=0, block_size=(16, 32))
    with pytest.raises(ValueError, match="blocks"):
        masks.from_blocks(np.ones((3, 3), bool), seq_len_q=64, seq_len_k=64, block_size=16)
    with pytest.raises(ValueError, match="mask"):
        masks.from_dense(np.ones((4, 4), np.int8))
    with pytest.raises(ValueError, match="same sequence lengths"):
        masks.causal(64) & masks.causal(65)
    with pytest.raises(ValueError, match="broadcast"):
        masks.from_dense(np.ones((2, 3, 16, 16), bool)) & masks.from_dense(np.ones((3, 2, 16, 16), bool))
    doc, sinks = masks.document([40, 24], block_size=16), masks.streaming(64, 4, 16, block_size=16)
    for terms, seq_len_k in ((doc.terms, 80), (dataclasses.replace(doc.terms, global_tokens=1), 64)):
        with pytest.raises(ValueError, match="document term"):  # document bounds live in the token words
            masks.BlockMask(seq_len_q=64, seq_len_k=seq_len_k, q_block=16, kv_block=16, terms=terms,
                            **dict(zip(doc.array_names, doc.arrays)))
    arrays = dict(zip(sinks.array_names, sinks.arrays))
    arrays["tokens_k"] = arrays["tokens_k"] ^ (np.arange(64) == 10)  # a flagged key past the sink count
    with pytest.raises(ValueError, match="sinks need one count"):
        masks.BlockMask(seq_len_q=64, seq_len_k=64, q_block=16, kv_block=16, terms=sinks.terms, **arrays)
    both = doc & sinks  # different token words: the combination is exact, as bits
    assert both.terms.bits and not both.terms.document
    np.testing.assert_array_equal(both.to_dense(), doc.to_dense() & sinks.to_dense())


@pytest.mark.parametrize("module", ["flashbridge.masks", "flashbridge.torch_api.block_sparse"])
def test_docstring_examples_run(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------------------------- attention

def make_qkv(seed, b, sq, sk, hq, hkv, d, dtype=torch.float32, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hkv, dv or d, generator=g).to(dtype)
    return q, k, v


def check_attention(m, *, b=1, hq=2, hkv=1, d=16, dv=None, dtype=torch.float32, seed=0, softcap=0.0,
                    with_sinks=False, with_alibi=False, scale=None, jax_parity=False):
    """Forward, lse and every gradient (q, k, v, sinks) against the float64 reference with m.to_dense();
    with ``jax_parity`` the JAX front-end must give the same bits."""
    sq, sk = m.seq_len_q, m.seq_len_k
    q, k, v = make_qkv(seed, b, sq, sk, hq, hkv, d, dtype, dv)
    g = torch.Generator().manual_seed(seed + 1)
    sinks = torch.randn(hq, generator=g) if with_sinks else None
    alibi = torch.rand(hq, generator=g) * 0.3 + 0.05 if with_alibi else None
    dense = m.to_dense()
    kw = dict(softcap=softcap, sinks=sinks, alibi_slopes=alibi, softmax_scale=scale)
    leaves = [t.requires_grad_() for t in (q, k, v)] + ([sinks.requires_grad_()] if with_sinks else [])
    out, lse = torch_api.flash_attention(q, k, v, block_mask=m, return_lse=True, **kw)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    ro, rl = ref.flash_attention(*(np64(t) for t in (q, k, v)), mask=dense, softcap=softcap, softmax_scale=scale,
                                 sinks=None if sinks is None else np64(sinks),
                                 alibi_slopes=None if alibi is None else np64(alibi))
    rgrads = ref.flash_attention_bwd(np64(dout), *(np64(t) for t in (q, k, v)), mask=dense, softcap=softcap,
                                     softmax_scale=scale,
                                     sinks=None if sinks is None else np64(sinks),
                                     alibi_slopes=None if alibi is None else np64(alibi))
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sn = sinks.detach().clone().requires_grad_() if with_sinks else None
    no = naive_masked_attention(qn, kn, vn, np.ascontiguousarray(dense), scale=scale, softcap=softcap, sinks=sn,
                                alibi=alibi)
    ngrads = torch.autograd.grad(no, [qn, kn, vn] + ([sn] if with_sinks else []), dout)
    assert_close(out, ro, no, name="out")
    np.testing.assert_allclose(np.where(np.isinf(rl), 0, np64(lse) - np.where(np.isinf(rl), 0, rl)), 0, atol=2e-4)
    assert (np.isinf(np64(lse)) == np.isinf(rl)).all(), "rows that see nothing: lse -inf"
    for name, got, want, nv in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads, ngrads):
        assert_close(got, want, nv, name=name)
    if jax_parity:
        _jax_parity(m, q, k, v, dout, kw, out, lse, grads)
    return out, lse


def _jax_parity(m, q, k, v, dout, kw, out, lse, grads):
    jax = pytest.importorskip("jax")
    from flashbridge import jax_api

    args = [torch_to_jax(t) for t in (q, k, v)]
    jkw = {n: torch_to_jax(t) for n, t in kw.items() if isinstance(t, torch.Tensor)}
    jkw["softcap"], jkw["softmax_scale"] = kw["softcap"], kw["softmax_scale"]
    sinks = jkw.pop("sinks", None)

    def f(q, k, v, sinks, mask):
        return jax_api.flash_attention(q, k, v, block_mask=mask, sinks=sinks, return_lse=True, **jkw)

    (jo, jl), vjp = jax.vjp(jax.jit(f), *args, sinks, m)
    jgrads = vjp((torch_to_jax(dout), jax.numpy.zeros_like(jl)))
    np.testing.assert_array_equal(np.asarray(jo.astype("float32")), out.detach().float().numpy())
    np.testing.assert_array_equal(np.asarray(jl), lse.detach().numpy())
    for got, want in zip(jgrads[:3] + ((jgrads[3],) if sinks is not None else ()), grads):
        np.testing.assert_array_equal(np.asarray(got.astype("float32")), want.float().numpy())


CASES = {
    # name: (mask, extra check_attention keywords)
    "causal_gqa": (lambda: masks.causal(63, block_size=16), dict(hq=2, hkv=1, jax_parity=True)),
    "causal_short_q": (lambda: masks.causal(17, 40, block_size=16), dict()),
    "causal_long_q_empty_rows": (lambda: masks.causal(40, 17, block_size=(16, 32)), dict()),
    "sliding_window": (lambda: masks.sliding_window(63, 10, 3, block_size=(16, 32)), dict()),
    "streaming_sinks_softcap": (lambda: masks.streaming(63, 3, 8, block_size=16),
                                dict(with_sinks=True, softcap=4.0, jax_parity=True)),
    "document_per_batch": (lambda: masks.document([[20, 0, 30, 13], [40, 23]], block_size=32),
                           dict(b=2, jax_parity=True)),
    "document_bidirectional_gqa": (lambda: masks.document([25, 8, 30], causal=False, block_size=16),
                                   dict(hq=2, hkv=1)),
    "longformer_alibi": (lambda: masks.longformer(63, 5, [0, 40], block_size=32), dict(with_alibi=True, scale=0.4)),
    "bigbird": (lambda: masks.bigbird(50, window_blocks=0, num_global_blocks=1, num_random_blocks=1, seed=1,
                                      block_size=16), dict(d=32, dv=16, scale=-0.25)),
    "from_blocks_per_head": (lambda: masks.from_blocks(np.random.default_rng(2).random((2, 3, 2)) < 0.6,
                                                       seq_len_q=40, seq_len_k=17, block_size=16), dict()),
    "from_dense_per_batch_head": (lambda: masks.from_dense(np.random.default_rng(3).random((2, 2, 40, 40)) < 0.3,
                                                           block_size=16), dict(b=2)),
    "and_or": (lambda: (masks.causal(40, block_size=16) & masks.from_blocks(
        np.random.default_rng(4).random((3, 3)) < 0.7, seq_len_q=40, seq_len_k=40, block_size=16))
        | masks.sliding_window(40, 2, 2, block_size=16), dict()),
    "bfloat16": (lambda: masks.causal(40, block_size=16), dict(dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.thin(5)
def test_attention_matches_reference(case):
    build, kw = CASES[case]
    check_attention(build(), **kw)


# ----------------------------------------------------------------------------------- bands run dense

def _every_block(sq, sk, block):
    return masks.from_blocks(np.ones((-(-sq // block), -(-sk // block)), bool), seq_len_q=sq, seq_len_k=sk,
                             block_size=block)


def test_band_flag_marks_exactly_the_masks_that_are_their_band():
    rng = np.random.default_rng(12)
    band = [masks.causal(63, block_size=16), masks.causal(17, 40, block_size=16), masks.causal(40, 17, block_size=16),
            masks.sliding_window(63, 10, 3, block_size=(16, 32)), masks.causal(40, block_size=16)
            & masks.causal(40, block_size=16), masks.causal(40, block_size=16) & _every_block(40, 40, 16),
            masks.sliding_window(40, 5, block_size=16) | masks.sliding_window(40, 5, block_size=16)]
    not_band = [masks.causal(40, block_size=16) & masks.from_blocks(rng.random((3, 3)) < 0.5, seq_len_q=40,
                                                                     seq_len_k=40, block_size=16),
                masks.causal(40, block_size=16) & masks.from_blocks(rng.random((2, 3, 3)) < 2, seq_len_q=40,
                                                                     seq_len_k=40, block_size=16),  # per head
                masks.streaming(63, 3, 8, block_size=16), masks.document([20, 20], block_size=16),
                masks.longformer(40, 5, [0], block_size=16), masks.from_dense(np.tril(np.ones((40, 40), bool)),
                                                                             block_size=16),
                _every_block(40, 40, 16), masks.causal(40, block_size=16) | masks.sliding_window(40, 4, 4,
                                                                                               block_size=16)]
    assert all(m.band for m in band), [m.band for m in band]
    assert not any(m.band for m in not_band), [m.band for m in not_band]


def test_band_masks_plan_the_dense_window_kernels():
    """The shared plans turn a band mask into the dense plan of its window (the same launches, no mask
    arrays); a mask with the band's terms but fewer blocks keeps its lists."""
    from flashbridge.core_kernels import INTERPRETER, Target
    from flashbridge.core_kernels.block_sparse.plan import check_block_mask, layout_of
    from flashbridge.core_kernels.flash_attn import plan as P

    h200 = Target(interpret=False, num_sms=132)
    for m, causal, window in ((masks.causal(4096), True, (-1, -1)), (masks.sliding_window(4096, 1024), False,
                                                                     (1024, 0)),
                              (masks.sliding_window(4096, 100, 30, block_size=64), False, (100, 30)),
                              (masks.causal(1000, 4000), True, (-1, -1))):
        info = dict(q=((1, m.seq_len_q, 16, 128), "bfloat16"), k=((1, m.seq_len_k, 4, 128), "bfloat16"),
                    v=((1, m.seq_len_k, 4, 128), "bfloat16"))
        shape, options = P.check_attention_args(**info)
        _, dense_options = P.check_attention_args(**info, causal=causal, window_size=window)
        layout = check_block_mask(m, shape, options)
        assert layout.band
        for target in (h200, INTERPRETER):
            assert P.plan_attention_fwd(shape, options, target=target, sparse=layout) == P.plan_attention_fwd(
                shape, dense_options, target=target)
            assert P.plan_attention_bwd(shape, options, target=target, sparse=layout) == P.plan_attention_bwd(
                shape, dense_options, target=target)
    fewer = masks.causal(4096) & masks.from_blocks(np.eye(32, dtype=bool), seq_len_q=4096, seq_len_k=4096)
    shape, options = P.check_attention_args(q=((1, 4096, 16, 128), "bfloat16"), k=((1, 4096, 16, 128), "bfloat16"),
                                            v=((1, 4096, 16, 128), "bfloat16"))
    plan = P.plan_attention_fwd(shape, options, target=h200, sparse=layout_of(fewer))
    assert plan.launches[0].constexpr_dict()["BLOCK_SPARSE"] and "kv_indices" in plan.inputs


@pytest.mark.parametrize("name,build,dense_kw", [
    ("causal-gqa", lambda: masks.causal(63, block_size=16), dict(causal=True)),
    ("causal-long-q", lambda: masks.causal(40, 17, block_size=(16, 32)), dict(causal=True)),
    ("window-10-3", lambda: masks.sliding_window(63, 10, 3, block_size=(16, 32)), dict(window_size=(10, 3))),
    ("window-5-and-every-block", lambda: masks.sliding_window(40, 5, block_size=16) & _every_block(40, 40, 16),
     dict(window_size=(5, 0))),
])
def test_band_masks_give_the_dense_window_bits_in_both_frameworks(name, build, dense_kw):
    """A band mask through flash_attention: the float64 reference (forward, lse, every gradient), the bits of
    the dense call with the same window, and the JAX front-end's bits (jitted, the mask an argument)."""
    m = build()
    assert m.band
    hq, hkv = (4, 2) if "gqa" in name else (2, 1)
    out, lse = check_attention(m, hq=hq, hkv=hkv, seed=len(name), jax_parity=True)
    q, k, v = make_qkv(len(name), 1, m.seq_len_q, m.seq_len_k, hq, hkv, 16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    got, got_lse = torch_api.flash_attention(q, k, v, block_mask=m, return_lse=True)
    want, want_lse = torch_api.flash_attention(*leaves, return_lse=True, **dense_kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse) and torch.equal(got, out)
    dout = torch.randn(got.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(got, leaves, dout), torch.autograd.grad(want, leaves, dout)):
        assert torch.equal(a, b)


def test_masks_with_the_band_terms_but_fewer_blocks_keep_their_lists():
    m = masks.causal(40, block_size=16) & masks.from_blocks(np.eye(3, dtype=bool) | np.eye(3, k=-2, dtype=bool),
                                                             seq_len_q=40, seq_len_k=40, block_size=16)
    assert m.terms == masks.causal(40).terms and not m.band
    check_attention(m, jax_parity=True)


def test_rows_that_see_nothing_output_zero():
    dense = np.zeros((40, 40), bool)
    dense[20:, :10] = True
    m = masks.from_dense(dense, block_size=16)
    q, k, v = make_qkv(5, 1, 40, 40, 2, 2, 16)
    out, lse = torch_api.flash_attention(q, k, v, block_mask=m, return_lse=True)
    assert (out[:, :20] == 0).all() and torch.isinf(lse[..., :20]).all() and (lse[..., :20] < 0).all()
    assert torch.isfinite(lse[..., 20:]).all()


def test_block_mask_errors():
    q, k, v = make_qkv(0, 1, 32, 32, 2, 1, 16)
    m = masks.causal(32, block_size=16)
    with pytest.raises(ValueError, match="block_mask: causal"):
        torch_api.flash_attention(q, k, v, block_mask=m, causal=True)
    with pytest.raises(ValueError, match="block_mask: causal"):
        torch_api.flash_attention(q, k, v, block_mask=m, window_size=(4, 0))
    with pytest.raises(ValueError, match="block_mask: built for"):
        torch_api.flash_attention(q, k, v, block_mask=masks.causal(33, block_size=16))
    with pytest.raises(ValueError, match="block_mask: batch / head"):
        torch_api.flash_attention(q, k, v, block_mask=masks.from_dense(np.ones((3, 32, 32), bool), block_size=16))
    with pytest.raises(TypeError, match="block_mask"):
        torch_api.flash_attention(q, k, v, block_mask=np.ones((32, 32), bool))
    cu = torch.tensor([0, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed"):
        torch_api.flash_attention(q[0], k[0], v[0], block_mask=m, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                  max_seqlen_q=32, max_seqlen_k=32)


def test_two_launch_backward_matches_one_launch():
    """The dK/dV and dQ kernels as two launches give the same bits as the one-launch backward; dK/dV split
    over two programs per key block (D=256's default on a GPU) the same values; the interleaved program
    order (interleave_backward) the same bits."""
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.block_sparse.plan import layout_of
    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args,
                                                          plan_attention_bwd, plan_attention_fwd)
    from flashbridge.torch_api._runtime import execute

    m = masks.streaming(40, 2, 9, block_size=16) & masks.from_dense(
        np.random.default_rng(6).random((2, 40, 40)) < 0.8, block_size=16)
    q, k, v = make_qkv(7, 1, 40, 40, 2, 1, 32)
    info = lambda t: (tuple(t.shape), "float32")  # noqa: E731
    shape, options = check_attention_args(q=info(q), k=info(k), v=info(v))
    arrays = {n: torch.from_numpy(a) for n, a in zip(m.array_names, m.arrays) if a is not None}
    plan = plan_attention_fwd(shape, options, target=INTERPRETER, sparse=layout_of(m))
    out, lse = execute(plan, {"q": q, "k": k, "v": v, **{n: arrays[n] for n in plan.inputs if n in arrays}})
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8))
    results = []
    for config in (AttentionConfig(), AttentionConfig(fused_backward=False), AttentionConfig(dkdv_col_split=2),
                   AttentionConfig(interleave_backward=True)):
        plan = plan_attention_bwd(shape, options, target=INTERPRETER, sparse=layout_of(m), config=config)
        assert len(plan.launches) == (3 if config.fused_backward is False or config.dkdv_col_split else 2)
        given = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse, **arrays}
        results.append(execute(plan, {n: given[n] for n in plan.inputs}))
    for a, b, c, d in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)  # D/2 columns per program: another sum order
        torch.testing.assert_close(a, d, rtol=0, atol=0)


def test_torch_compile_fullgraph_and_opcheck():
    from flashbridge.torch_api.block_sparse import _sparse_bwd, _sparse_fwd, mask_tensors

    m = masks.streaming(40, 2, 9, block_size=16)
    q, k, v = (t.requires_grad_() for t in make_qkv(9, 1, 40, 40, 2, 1, 16))
    eager = torch_api.flash_attention(q, k, v, block_mask=m)
    compiled = torch.compile(lambda q, k, v, m: torch_api.flash_attention(q, k, v, block_mask=m), fullgraph=True)
    out = compiled(q, k, v, m)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    g_compiled = torch.autograd.grad(out.sum(), (q, k, v))
    g_eager = torch.autograd.grad(eager.sum(), (q, k, v))
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    t = m.terms
    static = (m.q_block, m.kv_block, t.window_left, t.window_right, t.global_tokens, t.document, 0.25, 0.0)
    arrays = mask_tensors(m, "cpu")
    torch.library.opcheck(_sparse_fwd.custom_op, (q, k, v, None, None, arrays, *static))
    out, lse = _sparse_fwd(q.detach(), k.detach(), v.detach(), None, None, arrays, *static)
    torch.library.opcheck(_sparse_bwd.custom_op, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                                                  lse, None, None, None, arrays, *static, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_masks_from_flex():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    doc = torch.tensor(np.repeat([0, 1, 2], [30, 10, 30]))

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    flex = fa.create_block_mask(mask_mod, None, None, 70, 70, device="cpu", BLOCK_SIZE=32)
    m = torch_api.masks_from_flex(flex)
    want = defined("document", lengths=[30, 10, 30], causal=True)
    np.testing.assert_array_equal(m.to_dense()[0, 0], want)
    _check_lists(m, want)
    check_attention(m)
    with pytest.raises(TypeError, match="flex_block_mask"):
        torch_api.masks_from_flex(m)


# ----------------------------------------------------------------------------------------------- JAX

def _jax():
    return pytest.importorskip("jax")


def test_jax_pytree_jit_serves_masks_of_one_shape():
    jax = _jax()
    from flashbridge import jax_api

    q, k, v = (torch_to_jax(t) for t in make_qkv(10, 1, 40, 40, 2, 1, 16))
    rng = np.random.default_rng(11)

    def top2(seed):  # two of three key blocks per query block: every mask has the same shapes
        order = np.random.default_rng(seed).random((3, 3)).argsort(1)[:, :2]
        blocks = np.zeros((3, 3), bool)
        np.put_along_axis(blocks, order, True, 1)
        return masks.from_blocks(blocks, seq_len_q=40, seq_len_k=40, block_size=16)

    traces = []

    @jax.jit
    def f(q, k, v, mask):
        traces.append(1)
        return jax_api.flash_attention(q, k, v, block_mask=mask)

    for seed in rng.integers(0, 1000, 2):
        m = top2(int(seed))
        out = f(q, k, v, m)
        want, _ = ref.flash_attention(*(np.asarray(a) for a in (q, k, v)), mask=m.to_dense())
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)
    assert len(traces) == 1
    leaves, treedef = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 10 and jax.tree_util.tree_unflatten(treedef, leaves).terms == m.terms


def test_jax_vmap_shared_and_batched_masks():
    jax = _jax()
    import jax.numpy as jnp
    from flashbridge import jax_api

    q, k, v = (torch_to_jax(t) for t in make_qkv(12, 2, 40, 40, 2, 1, 16))
    per_batch = masks.document([[10, 30], [25, 15]], block_size=16)
    qs = jnp.stack([q, q * 0.5])
    out = jax.vmap(lambda q: jax_api.flash_attention(q, k, v, block_mask=per_batch))(qs)
    for i in range(2):
        want, _ = ref.flash_attention(np.asarray(qs[i]), np.asarray(k), np.asarray(v), mask=per_batch.to_dense())
        np.testing.assert_allclose(np.asarray(out[i]), want, atol=2e-6)
    # a batched mask (stacked masks of one shape: each query block sees two key blocks, each key block is seen
    # by two query blocks)
    grids = [np.roll(np.eye(3, dtype=bool), s, axis=1) | np.roll(np.eye(3, dtype=bool), s + 1, axis=1)
             for s in (0, 1)]
    batch = [masks.from_blocks(g, seq_len_q=40, seq_len_k=40, block_size=16) for g in grids]
    dense = [mm.to_dense()[0, 0] for mm in batch]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *batch)

    def loss(q, m):
        return jnp.sum(jax_api.flash_attention(q, k, v, block_mask=m) ** 2)

    grads = jax.vmap(jax.grad(loss))(qs, stacked)
    for i in range(2):
        o, _ = ref.flash_attention(np.asarray(qs[i]), np.asarray(k), np.asarray(v), mask=dense[i])
        gq = ref.flash_attention_bwd(2 * o, np.asarray(qs[i]), np.asarray(k), np.asarray(v), mask=dense[i])[0]
        np.testing.assert_allclose(np.asarray(grads[i]), gq, atol=1e-5)


def test_jax_shard_map_over_heads_with_a_per_head_mask():
    jax = _jax()
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    from flashbridge import jax_api

    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 host devices (XLA_FLAGS set in conftest)")
    mesh = Mesh(np.array(devices[:2]), ("heads",))
    q, k, v = (torch_to_jax(t) for t in make_qkv(15, 1, 30, 30, 4, 2, 16))
    m = masks.from_dense(np.random.default_rng(16).random((4, 30, 30)) < 0.4, block_size=16)
    spec = P(None, None, "heads", None)
    # the lists' head axis split like q's; the bits and token rows (addressed through the lists) replicated
    mask_spec = jax.tree.map(lambda a: P(None, "heads") if a.ndim >= 3 else P(), m)

    def f(q, k, v, m):
        return jax_api.flash_attention(q, k, v, block_mask=m)

    sharded = jax.jit(shard_map(f, mesh=mesh, in_specs=(spec, spec, spec, mask_spec), out_specs=spec))
    np.testing.assert_array_equal(np.asarray(sharded(q, k, v, m)), np.asarray(f(q, k, v, m)))
    g_sharded = jax.grad(lambda *a: sharded(*a, m).sum(), argnums=(0, 1, 2))(q, k, v)
    g_plain = jax.grad(lambda *a: f(*a, m).sum(), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_sharded, g_plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_jax_errors():
    _jax()
    import jax.numpy as jnp
    from flashbridge import jax_api

    x = jnp.ones((1, 32, 2, 16))
    with pytest.raises(ValueError, match="block_mask: causal"):
        jax_api.flash_attention(x, x, x, block_mask=masks.causal(32, block_size=16), causal=True)
    with pytest.raises(ValueError, match="block_mask: built for"):
        jax_api.flash_attention(x, x, x, block_mask=masks.causal(31, block_size=16))
