"""MLA (DeepSeek latent attention) on the CPU (Triton interpreter): reference, torch and JAX front-ends.

Kernel results are compared with the float64 reference (flashbridge.reference.mla) under the flash-attn rule:
error <= 2 x the error of a naive implementation in the same dtype + a small floor. Latent dims are small
(``Dqk = Dv + rope`` like 40 = 32 + 8, one 576 = 512 + 64 case with tiny S and H to run the tuned shapes),
lengths odd (17, 63), top-k small, sparse indices padded with -1.
"""
from __future__ import annotations

import numpy as np
import pytest

from flashbridge.reference import mla as ref
from helpers import assert_close, assert_same_ptx, np64, sm90_backend, torch_to_jax
from helpers import assert_lse_close as _check_lse, mla_sparse_indices as _sparse_indices, naive_mla as naive


def _rng(seed):
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------- reference

def test_reference_absorbed_equals_unabsorbed():
    rng = _rng(0)
    b, sq, sk, h, dn, dr, r, dv = 2, 5, 9, 3, 6, 4, 8, 5
    q_nope, q_rope = rng.standard_normal((b, sq, h, dn)), rng.standard_normal((b, sq, h, dr))
    c_kv, k_rope = rng.standard_normal((b, sk, r)), rng.standard_normal((b, sk, dr))
    w_uk, w_uv = rng.standard_normal((h, dn, r)), rng.standard_normal((h, dv, r))
    scale = 1.0 / np.sqrt(dn + dr)
    for causal, indices in ((False, None), (True, None), (False, _sparse_indices(rng, b, sq, sk, 4))):
        want, want_lse = ref.mla_unabsorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=causal,
                                            softmax_scale=scale, indices=indices)
        out, lse = ref.mla_attention(ref.absorb_query(q_nope, q_rope, w_uk), ref.latent_cache(c_kv, k_rope),
                                     head_dim_v=r, causal=causal, softmax_scale=scale, indices=indices)
        np.testing.assert_allclose(ref.unabsorb_output(out, w_uv), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_reference_indices_semantics():
    """Indices listing every visible key give the dense (or causal) result; -1 and out-of-range entries are
    skipped; a query whose list is empty outputs 0 with lse -inf."""
    rng = _rng(1)
    b, sq, sk, h, d, dv = 2, 4, 7, 3, 12, 8
    q, kv = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, d))
    every = np.broadcast_to(np.arange(sk, dtype=np.int32), (b, sq, sk)).copy()
    for causal in (False, True):
        dense = ref.mla_attention(q, kv, head_dim_v=dv, causal=causal)
        padded = np.concatenate([every[..., ::-1], np.full((b, sq, 3), -1, np.int32), every[..., :2] + sk], -1)
        sparse = ref.mla_attention(q, kv, head_dim_v=dv, causal=causal, indices=padded)
        for x, y in zip(dense, sparse):
            np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13)
    empty = np.full((b, sq, 4), -1, np.int32)
    out, lse = ref.mla_attention(q, kv, head_dim_v=dv, indices=empty)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_reference_backward_matches_finite_differences():
    rng = _rng(2)
    b, sq, sk, h, d, dv = 1, 3, 5, 2, 6, 4
    q, kv = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, d))
    dout, dlse = rng.standard_normal((b, sq, h, dv)), rng.standard_normal((b, h, sq))
    indices = _sparse_indices(rng, b, sq, sk, 3, causal=True, pad=0.0)
    for kw in (dict(causal=True), dict(indices=indices, causal=True), dict()):
        def loss(q_, kv_):
            out, lse = ref.mla_attention(q_, kv_, head_dim_v=dv, softmax_scale=0.7, **kw)
            return np.sum(out * dout) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse)

        dq, dkv = ref.mla_attention_bwd(dout, q, kv, head_dim_v=dv, softmax_scale=0.7, dlse=dlse, **kw)
        eps = 1e-6
        for x, grad in ((q, dq), (kv, dkv)):
            num = np.zeros_like(x)
            for pos in np.ndindex(x.shape):
                xp, xm = x.copy(), x.copy()
                xp[pos] += eps
                xm[pos] -= eps
                args_p = (xp, kv) if x is q else (q, xp)
                args_m = (xm, kv) if x is q else (q, xm)
                num[pos] = (loss(*args_p) - loss(*args_m)) / (2 * eps)
            np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)


def test_reference_decode_paged_equals_contiguous_and_prefill():
    """Decode over a paged cache (shuffled pages) equals decode over the contiguous cache, and decode with
    full lengths equals the causal prefill form."""
    rng = _rng(3)
    b, sq, h, d, dv, page = 2, 3, 4, 10, 8, 4
    lens = [7, 13]
    s_max = 16
    q = rng.standard_normal((b, sq, h, d))
    kv = rng.standard_normal((b, s_max, d))
    pool = rng.standard_normal((b * s_max // page + 2, page, d))
    perm = rng.permutation(pool.shape[0])
    table = np.full((b, s_max // page), -1, np.int32)
    for i in range(b):
        for j in range(-(-lens[i] // page)):
            table[i, j] = perm[i * (s_max // page) + j]
            rows = kv[i, j * page:(j + 1) * page]
            pool[table[i, j], :rows.shape[0]] = rows
    indices = _sparse_indices(rng, b, sq, s_max, 5)
    for kw in (dict(), dict(indices=indices)):
        a = ref.mla_decode(q, kv, cache_seqlens=lens, head_dim_v=dv, **kw)
        p = ref.mla_decode(q, pool, cache_seqlens=lens, block_table=table, head_dim_v=dv, **kw)
        for x, y in zip(a, p):
            np.testing.assert_array_equal(x, y)
    full = ref.mla_decode(q, kv, cache_seqlens=[s_max, s_max], head_dim_v=dv)
    prefill = ref.mla_attention(q, kv, head_dim_v=dv, causal=True)
    for x, y in zip(full, prefill):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------- helpers

torch = pytest.importorskip("torch")
tapi = pytest.importorskip("flashbridge.torch_api.mla")


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _make(seed, b, sq, sk, h, dqk, dtype="float32"):
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPES[dtype]
    return torch.randn(b, sq, h, dqk, generator=g).to(dt), torch.randn(b, sk, dqk, generator=g).to(dt)


# (b, sq, sk, h, dqk, dv, causal, topk, dtype)
CASES = {
    "h1-48-32": (1, 7, 17, 1, 48, 32, False, 0, "float32"),
    "h3-40-32-causal-s63": (2, 63, 63, 3, 40, 32, True, 0, "float32"),
    "h16-40-32-sq5-sk17-causal": (2, 5, 17, 16, 40, 32, True, 0, "float32"),
    "h3-dv-eq-dqk": (2, 9, 17, 3, 32, 32, False, 0, "float32"),
    "h3-sparse": (2, 5, 17, 3, 40, 32, False, 6, "float32"),
    "h16-sparse-causal": (1, 9, 63, 16, 40, 32, True, 20, "float32"),
    "h3-bf16-causal": (2, 17, 17, 3, 40, 32, True, 0, "bfloat16"),
    "h2-576-512-causal": (1, 3, 17, 2, 576, 512, True, 0, "bfloat16"),
    "h128-sparse-two-row-blocks": (1, 3, 17, 128, 40, 32, True, 5, "float32"),
    "h3-sq-above-sk-causal": (2, 9, 5, 3, 40, 32, True, 0, "float32"),
    "h3-sq-above-sk-sparse": (2, 9, 5, 3, 40, 32, True, 3, "float32"),
}


def _case(name):
    b, sq, sk, h, dqk, dv, causal, topk, dtype = CASES[name]
    q, kv = _make(zlib_seed(name), b, sq, sk, h, dqk, dtype)
    indices = None
    if topk:
        indices = torch.from_numpy(_sparse_indices(_rng(zlib_seed(name) + 1), b, sq, sk, topk, causal=causal))
    return q, kv, dict(head_dim_v=dv, causal=causal, indices=indices)


def zlib_seed(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode())


def _np_kw(kw):
    return {n: (v.numpy() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}


# --------------------------------------------------------------------------------------- torch prefill

@pytest.mark.parametrize("name", list(CASES))
def test_torch_mla_attention_forward(name):
    q, kv, kw = _case(name)
    out, lse = tapi.mla_attention(q, kv, **kw, return_lse=True)
    ro, rl = ref.mla_attention(np64(q), np64(kv), **_np_kw(kw))
    no, nl = naive(q, kv, **kw)
    assert out.dtype == q.dtype and tuple(out.shape) == ro.shape and tuple(lse.shape) == rl.shape
    floor = 1e-5 if q.dtype == torch.float32 else 1e-3
    assert_close(out, ro, no, name="out", floor=floor)
    _check_lse(lse, rl, nl, floor=floor)


@pytest.mark.parametrize("name", ["h3-40-32-causal-s63", "h16-40-32-sq5-sk17-causal", "h3-sparse",
                                  "h16-sparse-causal", "h1-48-32", "h128-sparse-two-row-blocks",
                                  "h3-sq-above-sk-causal", "h3-sq-above-sk-sparse"])
def test_torch_mla_attention_backward(name):
    q, kv, kw = _case(name)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out, lse = tapi.mla_attention(q, kv, **kw, return_lse=True)
    g = torch.Generator().manual_seed(7)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    torch.autograd.backward((out, lse), (dout, dlse))
    rdq, rdkv = ref.mla_attention_bwd(np64(dout), np64(q), np64(kv), dlse=np64(dlse), **_np_kw(kw))
    nq, nkv = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    no, nl = naive(nq, nkv, **kw)
    torch.autograd.backward((no, nl), (dout, torch.where(torch.isfinite(nl), dlse, 0.0)))
    assert_close(q.grad, rdq, nq.grad, name="dq")
    assert_close(kv.grad, rdkv, nkv.grad, name="dkv")


def test_torch_backward_is_deterministic():
    q, kv, kw = _case("h16-sparse-causal")
    grads = []
    for _ in range(2):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        tapi.mla_attention(qq, kk, **kw).sum().backward()
        grads.append((qq.grad, kk.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_torch_lse_only_gradient():
    q, kv, kw = _case("h3-40-32-causal-s63")
    q, kv = q.requires_grad_(), kv.requires_grad_()
    _, lse = tapi.mla_attention(q, kv, **kw, return_lse=True)
    torch.where(torch.isfinite(lse), lse, 0.0).sum().backward()
    dlse = np.ones(lse.shape)
    rdq, rdkv = ref.mla_attention_bwd(np.zeros(q.shape[:3] + (kw["head_dim_v"],)), np64(q), np64(kv), dlse=dlse,
                                      **_np_kw(kw))
    np.testing.assert_allclose(np64(q.grad), rdq, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np64(kv.grad), rdkv, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------- torch decode

def make_cache(seed, *, b=3, lens=(0, 1, 30), sq=1, h=3, dqk=40, dv=32, page_size=None, fp8=False, topk=0,
               dtype="float32", spare_pages=3):
    """Random decode inputs: q, a contiguous or paged latent cache (shuffled pages, -1 in unused table
    entries), cache_seqlens, FP8 scale, top-k indices (-1 padded, some past the sequence)."""
    g = torch.Generator().manual_seed(seed)
    s_max = max(max(lens), 1)
    dt = TORCH_DTYPES[dtype]
    q = torch.randn(b, sq, h, dqk, generator=g).to(dt)
    logical = torch.randn(b, s_max, dqk, generator=g)
    kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32), "head_dim_v": dv}
    if fp8:
        kw["kv_scale"] = torch.rand((), generator=g) * 0.5 + 0.25
        logical = (logical / kw["kv_scale"]).to(torch.float8_e4m3fn)
    else:
        logical = logical.to(dt)
    if page_size is None:
        cache = logical
    else:
        max_pages = -(-s_max // page_size)
        n_pages = b * max_pages + spare_pages
        perm = torch.randperm(n_pages, generator=g)
        table = torch.full((b, max_pages), -1, dtype=torch.int32)
        cache = torch.randn(n_pages, page_size, dqk, generator=g).to(logical.dtype)
        for i in range(b):
            for j in range(-(-lens[i] // page_size)):
                page = int(perm[i * max_pages + j])
                table[i, j] = page
                rows = logical[i, j * page_size:(j + 1) * page_size]
                cache[page, :rows.shape[0]] = rows
        kw["block_table"] = table
    if topk:
        idx = np.full((b, sq, topk), -1, dtype=np.int32)
        rng = _rng(seed)
        for i in range(b):
            for t in range(sq):
                visible = max(lens[i] - sq + t + 1, 0)
                chosen = rng.permutation(visible)[:topk]
                idx[i, t, :len(chosen)] = chosen
                if len(chosen) < topk:
                    idx[i, t, -1] = lens[i] + 2  # past the sequence: skipped
                idx[i, t] = rng.permutation(idx[i, t])
        kw["indices"] = torch.from_numpy(idx)
    return q, cache, kw


def _cache_np(t):
    if t.dtype == torch.float8_e4m3fn:
        import ml_dtypes
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return np64(t)


def decode_reference(q, cache, kw):
    return ref.mla_decode(np64(q), _cache_np(cache), **{n: (v.numpy() if isinstance(v, torch.Tensor) else v)
                                                         for n, v in kw.items()})


def decode_naive(q, cache, kw):
    """The decode computed plainly in q's dtype over the gathered, dequantised cache."""
    lens = kw["cache_seqlens"].tolist()
    s_max = max(max(lens), 1)
    kv = torch.zeros(q.shape[0], s_max, q.shape[-1], dtype=q.dtype)
    table = kw.get("block_table")
    for b, length in enumerate(lens):
        j = torch.arange(length)
        rows = cache[b, :length] if table is None else cache[table[b, j // cache.shape[1]].long(), j % cache.shape[1]]
        rows = rows.double()
        if "kv_scale" in kw:
            rows = rows * kw["kv_scale"].double()
        kv[b, :length] = rows.to(q.dtype)
    return naive(q, kv, head_dim_v=kw["head_dim_v"], causal=True, indices=kw.get("indices"), lengths=lens)


def check_decode(q, cache, kw, *, api=None, num_splits=None, floor=1e-5):
    out, lse = (api or tapi).mla_decode(q, cache, **kw, num_splits=num_splits, return_lse=True)
    ro, rl = decode_reference(q, cache, kw)
    no, nl = decode_naive(q, cache, kw)
    assert_close(out, ro, no, name="out", floor=floor)
    _check_lse(lse, rl, nl, floor=floor)
    for i, length in enumerate(kw["cache_seqlens"].tolist()):
        if length == 0:
            assert np.all(np64(out)[i] == 0.0) and np.all(np.isneginf(np64(lse)[i]))
    return out, lse


DECODE_CASES = {
    "contig-h3": dict(lens=(0, 1, 30)),
    "contig-h16-sq3": dict(lens=(5, 1, 33), sq=3, h=16),
    "paged4": dict(lens=(0, 7, 29), page_size=4),
    "paged16-h1-48": dict(lens=(17, 0, 40), page_size=16, h=1, dqk=48),
    "sparse-contig": dict(lens=(3, 30, 19), topk=8),
    "sparse-paged4-sq2": dict(lens=(9, 2, 31), topk=5, page_size=4, sq=2),
    "fp8-paged8": dict(lens=(0, 12, 31), fp8=True, page_size=8),
    "fp8-sparse": dict(lens=(4, 25, 30), fp8=True, topk=6),
    "bf16-576-512": dict(lens=(17, 5, 1), h=2, dqk=576, dv=512, dtype="bfloat16", page_size=16),
    "fp8-bf16q-576-512": dict(lens=(9, 17, 0), h=2, dqk=576, dv=512, dtype="bfloat16", fp8=True),
    # 16-bit queries and even dims: the FP8 latent is read as column pairs (PAIRS; the cases above with Dqk 40 =
    # 32 + 8 widen in registers: 8 rope dims are too few pairs for a dot)
    "fp8-pairs-paged8-bf16q": dict(lens=(0, 12, 31), fp8=True, page_size=8, dqk=96, dv=64, dtype="bfloat16"),
    "fp8-pairs-sparse-f16q": dict(lens=(4, 25, 30), fp8=True, topk=6, dqk=64, dv=32, dtype="float16"),
    "fp8-pairs-no-rest-sq2": dict(lens=(5, 1, 33), fp8=True, dqk=64, dv=64, dtype="bfloat16", sq=2, h=5),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_torch_mla_decode(name):
    spec = DECODE_CASES[name]
    q, cache, kw = make_cache(zlib_seed(name), **spec)
    check_decode(q, cache, kw, floor=1e-5 if q.dtype == torch.float32 else 1e-3)


def _fp8_plan_flags(dtype="bfloat16", dqk=96, dv=64, kv_strides=None, config=None):
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.mla.plan import check_mla_decode_args, plan_mla_fwd

    shape, options, _ = check_mla_decode_args(q=((2, 1, 4, dqk), dtype), kv_cache=((2, 40, dqk), "float8_e4m3fn"),
                                              cache_seqlens=((2,), "int32"), head_dim_v=dv, kv_scale=((), "float32"))
    launch = plan_mla_fwd(shape, options, target=INTERPRETER, strides={"kv": kv_strides} if kv_strides else None,
                          config=config).launches[0]
    flags = launch.constexpr_dict()
    return flags["PAIRS"], flags["SEPARATE_V"]


def test_fp8_latent_read_as_column_pairs_where_the_shapes_allow():
    """PAIRS (the latent read once as 16-bit column pairs, widened as K and as V) for 16-bit queries with even
    Dv and Dqk - Dv, >= 16 pairs in each part and even cache strides; otherwise (or with
    MLAConfig(fp8_pairs=False)) the tiles are widened in registers and V is loaded again (SEPARATE_V)."""
    from flashbridge.core_kernels.mla.plan import MLAConfig

    assert _fp8_plan_flags() == (True, False)
    assert _fp8_plan_flags("float16", dqk=64, dv=64) == (True, False)
    assert _fp8_plan_flags(dqk=576, dv=512) == (True, False)
    for kw in (dict(dtype="float32"), dict(dqk=40, dv=32), dict(dqk=96, dv=63), dict(dqk=95, dv=64),
               dict(kv_strides=(40 * 97, 97)), dict(config=MLAConfig(fp8_pairs=False))):
        assert _fp8_plan_flags(**kw) == (False, True), kw
    assert _fp8_plan_flags(config=MLAConfig(fp8_pairs=False, separate_v=False)) == (False, False)
    with pytest.raises(ValueError, match="MLAConfig.fp8_pairs"):
        MLAConfig(fp8_pairs=1)


def _decode_in_both(q, cache, kw, dv, num_splits):
    """mla_decode in torch and (jitted) in JAX, asserted bit-equal; the torch output as float64."""
    out_t = tapi.mla_decode(q, cache, **kw, head_dim_v=dv, num_splits=num_splits)
    out_j = jax.jit(lambda q, c, kw: japi.mla_decode(q, c, **kw, head_dim_v=dv, num_splits=num_splits))(
        torch_to_jax(q), torch_to_jax(cache), _j(kw))
    np.testing.assert_array_equal(np64(out_j), np64(out_t))
    return np64(out_t)


@pytest.mark.parametrize("name", ["fp8-pairs-paged8-bf16q", "fp8-pairs-sparse-f16q"])
def test_fp8_column_pairs_agree_with_the_widened_tiles(name):
    """The two FP8 paths give the same attention (f16 dots on exact e4m3 values either way; sums in another
    order), in both front-ends, and JAX equals torch bit for bit on each."""
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.mla.plan import MLAConfig

    q, cache, kw = make_cache(zlib_seed(name) + 1, **DECODE_CASES[name])
    dv = kw.pop("head_dim_v")

    pairs = _decode_in_both(q, cache, kw, dv, 2)
    with configure(MLAConfig(fp8_pairs=False)):
        widened = _decode_in_both(q, cache, kw, dv, 2)
    np.testing.assert_allclose(pairs, widened, atol=2e-3, rtol=2e-2)


def test_torch_fp8_latent_must_start_on_a_pair():
    """An FP8 latent read as column pairs must start on a 2-byte boundary: a view 1 byte past one is refused
    before any launch, naming the cache; a copy of it runs."""
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(3 * 40 * 96 + 1, generator=g).to(torch.float8_e4m3fn)
    odd = flat[1:].view(3, 40, 96)
    q = torch.randn(3, 1, 4, 96, generator=g).to(torch.bfloat16)
    kw = dict(cache_seqlens=torch.tensor([40, 3, 17], dtype=torch.int32), head_dim_v=64,
              kv_scale=torch.tensor(0.5))
    with pytest.raises(ValueError, match="kv_cache: an FP8 cache must start on a 2-byte boundary"):
        tapi.mla_decode(q, odd, **kw)
    check_decode(q, odd.clone(), kw, floor=1e-3)


def test_torch_decode_split_counts_agree_and_fixed_split_is_reproducible():
    q, cache, kw = make_cache(11, lens=(31, 2, 17), page_size=4, topk=9)
    base = tapi.mla_decode(q, cache, **kw, num_splits=1)
    for splits in (2, 3, 5):
        out = tapi.mla_decode(q, cache, **kw, num_splits=splits)
        np.testing.assert_allclose(np64(out), np64(base), atol=2e-6, rtol=1e-5)
        assert torch.equal(out, tapi.mla_decode(q, cache, **kw, num_splits=splits))


def _no_host_reads(monkeypatch):
    """Make every way of reading a tensor's values on the host raise, and stub the launches (the
    interpreter itself reads its arguments on the host): what remains is the ops' own host path."""
    from flashbridge.torch_api._runtime import TORCH_DTYPES as dtypes

    def forbidden(name):
        def read(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called on the op's hot path (a host sync)")
        return read

    for name in ("item", "tolist", "numpy", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setattr(torch, "nonzero", forbidden("nonzero"))
    launched = []

    def execute(plan, inputs, out=None):
        launched.append(plan)
        return tuple(torch.empty(plan.spec(n).shape, dtype=dtypes[plan.spec(n).dtype]) for n in plan.results)

    monkeypatch.setattr(tapi, "execute", execute)
    return launched


@pytest.mark.parametrize("name", ["sparse-paged4-sq2", "fp8-sparse", "paged4"])
def test_torch_decode_reads_no_values_while_a_cuda_graph_is_captured(name, monkeypatch):
    """Under CUDA-graph capture (simulated: the CPU tensors stand in for device ones) mla_decode and the
    sparse mla_attention read no tensor values on the host -- not even to check them: indices with a
    repeated key pass unchecked -- and launch their plans. Outside capture the same call checks them."""
    q, cache, kw = make_cache(zlib_seed(name), **DECODE_CASES[name])
    if "indices" in kw:  # a repeated visible key: rejected when the values are read
        kw["indices"][0, -1, :2] = 0
        with pytest.raises(ValueError, match="more than once"):
            tapi.mla_decode(q, cache, **kw)
    with pytest.raises(ValueError, match="more than once"):
        tapi.mla_attention(q, q[:, :, 0], head_dim_v=kw["head_dim_v"], indices=torch.zeros(
            q.shape[0], q.shape[1], 2, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    launched = _no_host_reads(monkeypatch)
    out, lse = tapi.mla_decode(q, cache, **kw, return_lse=True)
    assert out.shape == (*q.shape[:3], kw["head_dim_v"]) and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    tapi.mla_attention(q, q[:, :, 0], head_dim_v=kw["head_dim_v"], indices=torch.zeros(
        q.shape[0], q.shape[1], 2, dtype=torch.int32))
    assert len(launched) == 2


def test_torch_decode_of_full_cache_equals_causal_prefill():
    q, kv = _make(3, 2, 4, 13, 3, 40)
    lens = torch.tensor([13, 13], dtype=torch.int32)
    a = tapi.mla_decode(q, kv, cache_seqlens=lens, head_dim_v=32, num_splits=1)
    b = tapi.mla_attention(q, kv, head_dim_v=32, causal=True)
    np.testing.assert_allclose(np64(a), np64(b), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------- errors

def _bad_attention(**override):
    q, kv = _make(0, 1, 3, 5, 2, 40)
    args = dict(q=q, kv=kv, head_dim_v=32)
    args.update(override)
    return lambda api: api.mla_attention(**args)


def _bad_decode(**override):
    q, cache, kw = make_cache(0, lens=(4, 6), b=2, page_size=4)
    args = dict(q=q, kv_cache=cache, **kw)
    args.update(override)
    return lambda api: api.mla_decode(args["q"], args["kv_cache"],
                                      **{n: v for n, v in args.items() if n not in ("q", "kv_cache")})


BAD = [
    ("dv-above-dqk", _bad_attention(head_dim_v=41), ValueError, "head_dim_v: must be between 1 and"),
    ("kv-dtype", _bad_attention(kv=torch.randn(1, 5, 40, dtype=torch.float16)), TypeError, "kv: must have q's dtype"),
    ("kv-4d", _bad_attention(kv=torch.randn(1, 5, 1, 40)), ValueError, "kv: expected 3 non-empty dimensions"),
    ("kv-dim", _bad_attention(kv=torch.randn(1, 5, 48)), ValueError, "q, kv: expected kv of shape"),
    ("heads", _bad_attention(q=torch.randn(1, 3, 129, 40)), ValueError, "129 query heads are not supported"),
    ("indices-dtype", _bad_attention(indices=torch.zeros(1, 3, 2, dtype=torch.int64)), TypeError,
     "indices: must be int32"),
    ("indices-shape", _bad_attention(indices=torch.zeros(1, 2, 2, dtype=torch.int32)), ValueError,
     r"indices: expected shape \(1, 3, topk\)"),
    ("duplicates", _bad_attention(indices=torch.tensor([[[1, 4, 1], [0, -1, -1], [2, 3, 9]]], dtype=torch.int32)),
     ValueError, "query 0 of sequence 0 lists key 1 more than once"),
    ("below-minus-one", _bad_attention(indices=torch.tensor([[[1, -2], [0, -1], [2, 3]]], dtype=torch.int32)),
     ValueError, r"indices: entry \(0, 0, 1\) = -2"),
    ("block-mask", _bad_attention(block_mask=object()), TypeError,
     "block_mask: expected a flashbridge.masks.BlockMask"),
    ("causal-type", _bad_attention(causal=1), TypeError, "causal: expected a bool"),
    ("decode-kv-scale-16bit", _bad_decode(kv_scale=torch.tensor(1.0)), ValueError,
     "kv_scale: only meaningful for a float8_e4m3fn cache"),
    ("decode-cache-dtype", _bad_decode(kv_cache=torch.randn(9, 4, 40, dtype=torch.float16)), TypeError,
     "kv_cache: dtype float16 is not supported"),
    ("decode-page-size", _bad_decode(kv_cache=torch.randn(9, 3, 40)), ValueError, "page size 3"),
    ("decode-seqlens", _bad_decode(cache_seqlens=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError,
     r"cache_seqlens: expected shape \(2,\)"),
    ("decode-length", _bad_decode(cache_seqlens=torch.tensor([1, 99], dtype=torch.int32)), ValueError,
     "cache_seqlens: sequence 1 needs 99 rows"),
    ("decode-dv", _bad_decode(head_dim_v=64), ValueError, "head_dim_v: must be between 1 and"),
    ("decode-dup", _bad_decode(indices=torch.tensor([[[3, 3]], [[0, 1]]], dtype=torch.int32)), ValueError,
     "lists key 3 more than once"),
    ("decode-splits", _bad_decode(num_splits=0), ValueError, "num_splits: must be between 1 and"),
]


@pytest.mark.parametrize("name,call,error,match", BAD, ids=[c[0] for c in BAD])
def test_torch_bad_inputs(name, call, error, match):
    with pytest.raises(error, match=match):
        call(tapi)


def test_decode_duplicates_past_the_length_and_padding_are_allowed():
    """Only the keys a query visits must be distinct: repeated -1 and repeated entries past the sequence
    are padding."""
    q, cache, kw = make_cache(5, lens=(4, 6), b=2)
    kw["indices"] = torch.tensor([[[0, -1, -1, 9, 9]], [[5, 1, 7, 7, -1]]], dtype=torch.int32)
    check_decode(q, cache, kw)


# ------------------------------------------------------------------------------------------------- JAX

jax = pytest.importorskip("jax")
jnp = jax.numpy
japi = pytest.importorskip("flashbridge.jax_api.mla")


def _j(kw):
    return {n: torch_to_jax(v) for n, v in kw.items()}


@pytest.mark.parametrize("name", ["h16-sparse-causal", "h3-40-32-causal-s63", "h2-576-512-causal"])
def test_jax_mla_attention_matches_torch_bitwise(name):
    """Forward and gradients under jit: the same kernels, the same bits as torch."""
    q, kv, kw = _case(name)
    idx = kw.pop("indices")

    def loss(q, kv, idx):
        out, lse = japi.mla_attention(q, kv, **kw, indices=idx, return_lse=True)
        return jnp.sum(out.astype(jnp.float32) * 0.5) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    (grads, (out, lse)) = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        torch_to_jax(q), torch_to_jax(kv), None if idx is None else torch_to_jax(idx))
    tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    tout, tlse = tapi.mla_attention(tq, tkv, **kw, indices=idx, return_lse=True)
    (tout.float().sum() * 0.5 + torch.where(torch.isfinite(tlse), tlse, 0.0).sum()).backward()
    for a, b in ((out, tout), (lse, tlse), (grads[0], tq.grad), (grads[1], tkv.grad)):
        np.testing.assert_array_equal(np64(a), np64(b))


def test_jax_vmap_folds_into_the_batch():
    q, kv, kw = _case("h3-sparse")
    idx = kw.pop("indices")
    qs, kvs, idxs = (torch.stack([x, x.flip(0)]) for x in (q, kv, idx))
    out = jax.vmap(lambda q, kv, i: japi.mla_attention(q, kv, **kw, indices=i))(
        torch_to_jax(qs), torch_to_jax(kvs), torch_to_jax(idxs))
    for v in range(2):
        want = tapi.mla_attention(qs[v], kvs[v], **kw, indices=idxs[v])
        np.testing.assert_array_equal(np64(out[v]), np64(want))
    grads = jax.vmap(jax.grad(lambda q, kv: jnp.sum(japi.mla_attention(q, kv, **kw)), argnums=(0, 1)))(
        torch_to_jax(qs), torch_to_jax(kvs))
    tq = qs[1].clone().requires_grad_()
    tapi.mla_attention(tq, kvs[1], **kw).sum().backward()
    np.testing.assert_array_equal(np64(grads[0][1]), np64(tq.grad))


@pytest.mark.parametrize("name", ["sparse-paged4-sq2", "fp8-paged8", "fp8-bf16q-576-512", "contig-h16-sq3",
                                  "fp8-pairs-paged8-bf16q", "fp8-pairs-sparse-f16q"])
def test_jax_mla_decode_matches_torch_bitwise(name):
    q, cache, kw = make_cache(zlib_seed(name), **DECODE_CASES[name])
    dv = kw.pop("head_dim_v")
    want, want_lse = tapi.mla_decode(q, cache, **kw, head_dim_v=dv, num_splits=2, return_lse=True)
    out, lse = jax.jit(lambda q, c, kw: japi.mla_decode(q, c, **kw, head_dim_v=dv, num_splits=2, return_lse=True))(
        torch_to_jax(q), torch_to_jax(cache), _j(kw))
    np.testing.assert_array_equal(np64(out), np64(want))
    np.testing.assert_array_equal(np64(lse), np64(want_lse))


def test_configure_sets_the_mla_plans_config_in_both_front_ends():
    """MLAConfig goes through core_kernels.configure like every family's config: the plans read it (an
    explicit config= wins), and both public decode ops plan with it -- 32-key steps move the split
    boundaries, so the bits change, and torch and JAX still agree bit for bit."""
    from flashbridge.core_kernels import INTERPRETER, configure
    from flashbridge.core_kernels.mla.plan import (MLAConfig, check_mla_args, check_mla_decode_args, plan_mla_bwd,
                                                   plan_mla_fwd)

    q, cache, kw = make_cache(31, lens=(60, 7, 45), h=4, topk=0)
    dv = kw.pop("head_dim_v")
    info = {n: (tuple(t.shape), str(t.dtype).split(".")[-1]) for n, t in kw.items()}
    shape, options, _ = check_mla_decode_args(q=(tuple(q.shape), "float32"), kv_cache=(tuple(cache.shape), "float32"),
                                              head_dim_v=dv, **info)

    def block_n(**extra):
        return plan_mla_fwd(shape, options, target=INTERPRETER, **extra).launches[0].constexpr_dict()["BLOCK_N"]

    default = block_n()
    with configure(MLAConfig(block_n=32)):
        assert block_n() == 32 and block_n(config=MLAConfig()) == default
        prefill, prefill_options = check_mla_args(q=((1, 8, 2, 40), "float32"), kv=((1, 8, 40), "float32"),
                                                  head_dim_v=32)
        with configure(MLAConfig(dkv_block_n=32)):  # the innermost wins
            bwd = plan_mla_bwd(prefill, prefill_options, target=INTERPRETER)
            assert [la.constexpr_dict()["BLOCK_N"] for la in bwd.launches if "dkv" in la.kernel] == [32]
            assert block_n() == default
    assert block_n() == default

    base = _decode_in_both(q, cache, kw, dv, 3)
    with configure(MLAConfig(block_n=32)):
        other = _decode_in_both(q, cache, kw, dv, 3)
    assert not np.array_equal(other, base)
    np.testing.assert_allclose(other, base, atol=2e-6, rtol=1e-5)


def test_jax_mla_decode_against_reference():
    q, cache, kw = make_cache(21, **DECODE_CASES["sparse-contig"])
    check_decode(q, cache, kw, api=_JaxAsTorch())


class _JaxAsTorch:
    """The JAX ops with torch tensors in and out (so the torch-side checks apply unchanged)."""

    @staticmethod
    def mla_decode(q, cache, **kw):
        res = japi.mla_decode(torch_to_jax(q), torch_to_jax(cache), **{n: torch_to_jax(v) for n, v in kw.items()})
        return tuple(torch.from_numpy(np.asarray(r).astype(np.float64)) for r in res)

    @staticmethod
    def mla_attention(q, kv, **kw):
        res = japi.mla_attention(torch_to_jax(q), torch_to_jax(kv), **{n: torch_to_jax(v) for n, v in kw.items()})
        return res


@pytest.mark.parametrize("name,call,error,match", [c for c in BAD if c[0] in (
    "dv-above-dqk", "duplicates", "block-mask", "decode-kv-scale-16bit", "decode-dup", "below-minus-one")],
    ids=lambda c: c if isinstance(c, str) else "")
def test_jax_bad_inputs(name, call, error, match):
    with pytest.raises(error, match=match):
        call(_JaxAsTorch())


# ---------------------------------------------------------------------------------------------- modules

MODULE_CONFIG = dict(hidden_size=48, num_heads=3, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16)


def _torch_module(q_lora_rank=24, seed=0):
    torch.manual_seed(seed)
    m = tapi.MultiHeadLatentAttention(**{**MODULE_CONFIG, "q_lora_rank": q_lora_rank})
    with torch.no_grad():
        for p in m.parameters():  # norm weights away from 1, projections of a realistic size
            p.add_(torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_torch_module_paths_agree(q_lora_rank):
    """Prefill / training (un-absorbed, flash_attention with Dqk = nope + rope) and decode (absorbed,
    mla_decode over the latent cache), from the same weights: all tokens at once into an empty cache, then
    token by token into a paged cache (unused rows NaN: never read)."""
    m = _torch_module(q_lora_rank)
    x = torch.randn(2, 9, MODULE_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(1))
    want = m(x)
    latent = MODULE_CONFIG["kv_lora_rank"] + MODULE_CONFIG["qk_rope_head_dim"]
    got = m.decode(x, torch.zeros(2, 12, latent), torch.zeros(2, dtype=torch.int32))
    np.testing.assert_allclose(np64(got), np64(want), atol=2e-6, rtol=1e-5)
    cache = torch.full((7, 4, latent), float("nan"))
    table = torch.tensor([[3, 0, 5], [6, 1, 2]], dtype=torch.int32)
    steps = [m.decode(x[:, t:t + 1], cache, torch.full((2,), t, dtype=torch.int32), block_table=table)
             for t in range(9)]
    np.testing.assert_allclose(np64(torch.cat(steps, 1)), np64(want), atol=2e-6, rtol=1e-5)


def test_torch_module_trains():
    m = _torch_module()
    x = torch.randn(2, 5, MODULE_CONFIG["hidden_size"])
    m(x).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_flax_module_paths_agree_and_match_torch():
    from flax import nnx

    fm = pytest.importorskip("flashbridge.jax_api.mla_flax")
    tm = _torch_module()
    jm = fm.MultiHeadLatentAttention(**MODULE_CONFIG, rngs=nnx.Rngs(0))
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        getattr(jm, name).kernel[...] = jnp.asarray(getattr(tm, name).weight.detach().numpy().T)
    for name in ("q_a_layernorm", "kv_a_layernorm"):
        getattr(jm, name).scale[...] = jnp.asarray(getattr(tm, name).weight.detach().numpy())
    x = torch.randn(2, 7, MODULE_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    xj = jnp.asarray(x.numpy())
    want = jm(xj)
    np.testing.assert_allclose(np.asarray(want), np64(tm(x)), atol=2e-6, rtol=1e-5)
    latent = MODULE_CONFIG["kv_lora_rank"] + MODULE_CONFIG["qk_rope_head_dim"]
    step = nnx.jit(lambda m, x, c, n: m.decode(x, c, n))
    cache, outs = jnp.zeros((2, 8, latent)), []
    for t in range(0, 7, 3):  # chunks of 3, 3, 1 new tokens
        out, cache = step(jm, xj[:, t:t + 3], cache, jnp.full((2,), t, jnp.int32))
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), np.asarray(want), atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------------------ decode_attention routing

@pytest.mark.parametrize("layout,paged,fp8", [("NHD", False, False), ("HND", True, False), ("NHD", True, True)])
def test_decode_attention_routes_latent_views_to_the_mla_kernel(layout, paged, fp8, monkeypatch):
    """decode_attention with one KV head and v_cache = k_cache[..., :Dv] (a view) runs the MLA kernel and
    equals mla_decode bit for bit; a copy of the values (not a view) stays on the generic path."""
    from flashbridge.torch_api import decode as tdecode

    q, cache, kw = make_cache(31, lens=(9, 0, 30), h=4, page_size=8 if paged else None, fp8=fp8)
    dv = kw.pop("head_dim_v")
    want, want_lse = tapi.mla_decode(q, cache, **kw, head_dim_v=dv, return_lse=True)
    k = cache.unsqueeze(2) if layout == "NHD" else cache.unsqueeze(1)
    extra = {n: kw[n] for n in ("cache_seqlens", "block_table") if n in kw}
    if fp8:
        extra["k_scale"] = extra["v_scale"] = kw["kv_scale"]
    calls = []
    real = tapi._mla_decode
    monkeypatch.setattr(tapi, "_mla_decode", lambda *a: calls.append(a[1].shape) or real(*a))
    out, lse = tdecode.decode_attention(q, k, k[..., :dv], kv_layout=layout, **extra, return_lse=True)
    assert calls == [cache.shape]  # the (pages, rows, Dqk) view of the cache
    np.testing.assert_array_equal(np64(out), np64(want))
    np.testing.assert_array_equal(np64(lse), np64(want_lse))
    generic = tdecode.decode_attention(q, k, k[..., :dv].clone(), kv_layout=layout, **extra)
    assert len(calls) == 1
    np.testing.assert_allclose(np64(generic), np64(out), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["flashbridge.torch_api.mla", "flashbridge.jax_api.mla",
                                  pytest.param("flashbridge.jax_api.mla_flax", marks=pytest.mark.slow)])
def test_docstring_examples_run(name):
    import doctest
    import importlib

    pytest.importorskip("flax")
    module = importlib.import_module(name)
    globs = {**vars(module), "jax": jax, "jnp": jnp, "torch": torch}
    if name.endswith("mla_flax"):
        from flax import nnx
        globs["nnx"] = nnx
    result = doctest.testmod(module, globs=globs, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------------- compiled for the H200

def _h200_plans():
    """The default GPU plans of the benchmark's shapes: decode H=128 paged (dense, top-k), H=16 FP8,
    prefill causal (dense forward, sparse backward), prefill over the seed's block mask (64x64 blocks, 32 of
    64 per query block: forward, backward)."""
    from flashbridge import masks
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.block_sparse.plan import layout_of
    from flashbridge.core_kernels.mla import plan as P

    h200 = Target(interpret=False, num_sms=132)
    plans = []
    for heads, fp8, topk in ((128, False, 0), (128, False, 2048), (16, True, 0)):
        cache = "float8_e4m3fn" if fp8 else "bfloat16"
        shape, options, _ = P.check_mla_decode_args(
            q=((64, 1, heads, 576), "bfloat16"), kv_cache=((64 * 512, 64, 576), cache), cache_seqlens=((64,), "int32"),
            block_table=((64, 512), "int32"), head_dim_v=512, indices=((64, 1, topk), "int32") if topk else None,
            kv_scale=((), "float32") if fp8 else None)
        plans.append((f"decode H{heads} fp8={fp8} topk={topk}", P.plan_mla_fwd(shape, options, target=h200), cache))
    for topk in (0, 2048):
        shape, options = P.check_mla_args(q=((1, 4096, 128, 576), "bfloat16"), kv=((1, 4096, 576), "bfloat16"),
                                          head_dim_v=512, causal=True,
                                          indices=((1, 4096, topk), "int32") if topk else None)
        plans.append((f"prefill topk={topk}", (P.plan_mla_bwd if topk else P.plan_mla_fwd)(shape, options, target=h200),
                      "bfloat16"))
    top = _rng(0).random((64, 64)).argsort(1)[:, :32]
    blocks = np.zeros((64, 64), bool)
    np.put_along_axis(blocks, top, True, 1)
    layout = layout_of(masks.from_blocks(blocks, seq_len_q=4096, seq_len_k=4096, block_size=64))
    shape, options = P.check_mla_args(q=((1, 4096, 128, 576), "bfloat16"), kv=((1, 4096, 576), "bfloat16"),
                                      head_dim_v=512)
    for plan in (P.plan_mla_fwd, P.plan_mla_bwd):
        plans.append((f"prefill block mask {plan.__name__}", plan(shape, options, target=h200, sparse=layout),
                      "bfloat16"))
    return plans


def masks_array_names():
    from flashbridge.masks import BlockMask
    return BlockMask.array_names


@pytest.mark.slow  # ~2.5 minutes of compiles on a 2-core CPU
@pytest.mark.parametrize("index", range(7))
def test_kernels_compile_identically_and_fit_the_h200(index):
    """torch (Triton's launcher) and JAX (jax-triton) compile the same PTX for sm_90, every kernel of the
    default plans fits Hopper's 227 KB of shared memory per block, and the wgmma kernels keep their MMAs
    asynchronous (ptxas serialises them without failing when it cannot keep their registers live)."""
    import sys
    from pathlib import Path

    sm90_backend()  # skips without an NVIDIA backend / ptxas
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _common import compile_launch_sm90

    name, plan, cache_dtype = _h200_plans()[index]
    dtypes = {"q": "bfloat16", "kv": cache_dtype, "cache_seqlens": "int32", "block_table": "int32",
              "indices": "int32", "kv_scale": "float32", "dout": "bfloat16", "out": "bfloat16", "lse": "float32",
              **{n: "int32" for n in masks_array_names()}}
    dtypes.update({s.name: s.dtype for s in plan.buffers})
    for launch in plan.launches:
        if launch.kernel.startswith("mla."):
            assert_same_ptx(launch, dtypes)
        smem, usage = compile_launch_sm90(plan, launch, dtypes)
        assert smem <= 227 * 1024, f"{name} {launch.kernel}: {smem} B of shared memory"
        assert "SERIALIZED" not in usage, f"{name} {launch.kernel}: {usage}"


# ------------------------------------------------------------------------------------- torch.library ops

def test_torch_opcheck_and_compile():
    """The three ops pass torch.library's checks (schema, fake tensors, autograd registration, AOT dispatch);
    a function calling both public ops compiles with fullgraph and gives the eager bits; the eager fast path
    (FusedOp) equals the dispatcher path, gradients included."""
    from flashbridge.torch_api import _ops

    q, kv, kw = _case("h3-sparse")
    idx = kw["indices"]
    torch.library.opcheck(torch.ops.flashbridge.mla_fwd.default, (q, kv, idx, 32, 0.3, False))
    torch.library.opcheck(torch.ops.flashbridge.mla_fwd.default, (q, kv, None, 32, 0.3, True))
    out, lse = torch.ops.flashbridge.mla_fwd(q, kv, idx, 32, 0.3, False)
    torch.library.opcheck(torch.ops.flashbridge.mla_bwd.default,
                          (torch.randn_like(out), q, kv, out, lse, torch.randn_like(lse), idx, 32, 0.3, False))
    dq, dc, dkw = make_cache(3, lens=(7, 0, 30), page_size=8, topk=5)
    torch.library.opcheck(torch.ops.flashbridge.mla_decode.default,
                          (dq, dc, dkw["cache_seqlens"], dkw["block_table"], dkw["indices"], None, 32, 0.25, 2))

    def both(q, kv, dq, dc, lens, table):
        return tapi.mla_attention(q, kv, head_dim_v=32, causal=True), \
            tapi.mla_decode(dq, dc, cache_seqlens=lens, block_table=table, head_dim_v=32, num_splits=2)

    args = (q, kv, dq, dc, dkw["cache_seqlens"], dkw["block_table"])
    got = torch.compile(both, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(got, both(*args)):
        assert torch.equal(a, b)

    def grads(fast):
        old, _ops.FusedOp.eager_fast_path = _ops.FusedOp.eager_fast_path, fast
        try:
            qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
            out = tapi.mla_attention(qq, kk, head_dim_v=32, indices=idx)
            return (out, *torch.autograd.grad(out.square().sum(), (qq, kk)))
        finally:
            _ops.FusedOp.eager_fast_path = old

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)
