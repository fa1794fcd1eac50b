"""What the test suites share: the accuracy rule, converters, the naive same-dtype computations the rule
measures against, case builders used by a CPU suite and its GPU counterpart, and the sm_90 compile of a
launch as each front-end's launcher does it. Test modules import this module only, never each other.

The accuracy rule (the flash-attn rule, the same one ``flashbridge check`` applies): against the float64
reference, the kernel's error must be at most ``factor`` x the error of a naive implementation in the same
dtype, plus a small floor relative to the reference's magnitude.

torch, JAX and Triton's NVIDIA backend are imported inside the functions that need them, so a suite that
needs none of them still imports this module.
"""
from __future__ import annotations

import dataclasses
import math
import re
import socket
import types

import numpy as np
import pytest
import triton
import triton.language as tl

from flashbridge.checks import error_and_bound, rounded  # noqa: F401  (rounded is re-exported for tests)
from flashbridge.checks import to_numpy64 as np64  # noqa: F401
from flashbridge.core_kernels import get_kernel
from flashbridge.core_kernels._random import _philox_rounds, keep16


def assert_close(out, ref, naive, *, name="output", factor=2.0, floor=1e-5):
    """err(out) <= factor * err(naive) + floor * max(1, max|ref|), all against the float64 ``ref``."""
    err, bound = error_and_bound(out, ref, naive, factor=factor, floor=floor)
    assert err <= bound, (f"{name}: max error {err:.3g} > bound {bound:.3g} ({factor} x the naive "
                          f"same-dtype error + {floor} x max(1, |ref|))")


def assert_close_rowwise(out, ref, naive, *, name="output", factor=2.0, floor=1e-5, unit=None):
    """:func:`assert_close` with every row (last dimension) measured in units of its own max|ref| (or of
    ``unit``, one positive value per row, e.g. the size of the terms a row's result cancels from): for rows
    of very different magnitudes, where one bound for the whole array would ignore the small rows."""
    import numpy as np

    out, ref, naive = (np64(a).reshape(-1, np.shape(ref)[-1]) for a in (out, ref, naive))
    if unit is None:
        unit = np.max(np.abs(ref), axis=1)
    unit = np.maximum(np.reshape(unit, (-1, 1)), np.finfo(np.float64).tiny)
    assert_close(out / unit, ref / unit, naive / unit, name=name, factor=factor, floor=floor)


def assert_same_values(got, want, name, tol=2e-5):
    """Same NaN, +inf and -inf elements; the finite ones within ``tol`` relative to the largest reference value."""
    for kind, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        g, w = test(got), test(want)
        assert np.array_equal(g, w), (f"{name}: {kind} at {np.argwhere(g & ~w)[:4].tolist()} (not in the reference), "
                                      f"missing at {np.argwhere(w & ~g)[:4].tolist()}")
    fin = np.isfinite(want)
    if fin.any():
        err = np.max(np.abs(got[fin] - want[fin]))
        assert err <= tol * max(1.0, np.max(np.abs(want[fin]))), f"{name}: finite values differ by {err:.3g}"


def e4m3_bits_expected(values):
    """The e4m3fn bytes ``append_kv_cache`` stores for float values (already divided by the scale):
    ml_dtypes' cast of the value clamped to +-448 (nearest even), NaN as e4m3fn's NaN 0x7F whatever its sign."""
    import ml_dtypes
    import numpy as np

    v = np.asarray(values, np.float32)
    nan = np.isnan(v)
    bits = np.clip(np.where(nan, 0.0, v), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(nan, 0x7F, bits).astype(np.uint8)


def torch_to_jax(t):
    """A torch tensor as a JAX array with the same values and dtype (bf16 and fp8 included); anything else is
    returned as is. Imports torch and JAX lazily: suites that need neither still import this module."""
    import torch
    if not isinstance(t, torch.Tensor):
        return t
    import jax.numpy as jnp
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return jnp.asarray(t.view(torch.uint8).numpy()).view(jnp.float8_e4m3fn)
    return jnp.asarray(t.numpy())


def score_mod_inputs(g, b: int, hq: int, *, alibi=None, sinks=False, slope_range=0.5) -> dict:
    """Random optional score-modifier tensors of the attention and decode ops: ALiBi slopes per head
    ("heads", ``(Hq,)``) or per sequence and head ("batch", ``(B, Hq)``) in [0.05, 0.05 + slope_range),
    and attention sinks ``(Hq,)``; drawn from the torch generator ``g``."""
    import torch

    kw = {}
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(hq, generator=g) * slope_range + 0.05
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g) * slope_range + 0.05
    if sinks:
        kw["sinks"] = torch.randn(hq, generator=g)
    return kw


def naive_masked_attention(q, k, v, mask, *, scale=None, softcap=0.0, sinks=None, alibi=None):
    """Attention computed plainly in the inputs' dtype with a dense bool mask ``(B|1, H|1, Sq, Sk)``
    (differentiable; torch, any device): the block-sparse suites' yardstick (float64 on a GPU stands in for
    the NumPy reference at sizes where it would be slow). q ``(B, Sq, Hq, D)``, k / v ``(B, Sk, Hkv, D)``; rows
    that see nothing give 0."""
    import math

    import torch

    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        sq, sk = q.shape[1], k.shape[1]
        dist = (torch.arange(sq, device=q.device)[:, None] + sk - sq - torch.arange(sk, device=q.device)[None, :]).abs()
        s = s - (alibi.to(q.device)[:, None, None] * dist).to(s.dtype)
    s = s.masked_fill(~torch.as_tensor(mask, device=q.device), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    p = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


# --------------------------------------------------------------------------------------------- attention

def naive_torch(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None,
                softcap=0.0, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, dropout_mask=None, dropout_p=0.0,
                **_):
    """Attention computed plainly in the inputs' dtype (differentiable): the 'naive same-dtype
    implementation' the tolerance is measured against. Returns (out, lse). ``dropout_mask``: the bool keep
    mask ``(B, Hq, Sq_max, Sk_max)`` (``reference.attention.attention_dropout_mask``), kept probabilities
    scaled by ``1 / (1 - attention_dropout_rate(dropout_p))`` (p rounded to a multiple of 1/256)."""
    import torch

    from flashbridge.reference.attention import attention_dropout_rate, visible_mask

    dtype = q.dtype
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if cu_seqlens_q is None:
        seqs = [((i,), (i,)) for i in range(q.shape[0])]
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        seqs = [((slice(cq[i], cq[i + 1]),), (slice(ck[i], ck[i + 1]),)) for i in range(len(cq) - 1)]
    group = q.shape[-2] // k.shape[-2]
    outs, lses = [], []
    for i, (qs, ks) in enumerate(seqs):
        qq, kk, vv = q[qs], k[ks].repeat_interleave(group, -2), v[ks].repeat_interleave(group, -2)
        sq, sk = qq.shape[0], kk.shape[0]
        s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
            dist = (torch.arange(sq, device=q.device)[:, None] + sk - sq
                    - torch.arange(sk, device=q.device)[None, :]).abs()
            s = s - (slopes[:, None, None].to(q.device) * dist).to(dtype)
        mask = torch.from_numpy(visible_mask(sq, sk, causal=causal, window_size=window_size)).to(q.device)
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.to(dtype)[:, None, None].expand(-1, sq, 1)], dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.nan_to_num(torch.softmax(s, dim=-1))[..., :sk]
        if dropout_mask is not None:
            keep = torch.as_tensor(np.asarray(dropout_mask)[i, :, :sq, :sk], device=q.device)
            p = torch.where(keep, p / (1.0 - attention_dropout_rate(dropout_p)), 0.0).to(dtype)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        lses.append(lse)
    if cu_seqlens_q is None:
        return torch.stack(outs), torch.stack(lses)
    return torch.cat(outs), torch.cat(lses, dim=-1)



@triton.jit
def _keep16_probe(SEED, OUT, WORDS, a_start, b_start, c2, c3, threshold, LA: tl.constexpr, LB: tl.constexpr,
                  A_ROWS: tl.constexpr):
    """keep16's tile (int8, row-major) and, for LA * LB / 16 counters, its Philox rounds' words and
    tl.philox's side by side (WORDS: [8, LA * LB / 16])."""
    seed = tl.load(SEED)
    keep = keep16(seed, a_start, b_start, LA, LB, c2, c3, threshold, A_ROWS)
    R: tl.constexpr = LA if A_ROWS else LB
    C: tl.constexpr = LB if A_ROWS else LA
    tl.store(OUT + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :], keep.to(tl.int8))
    n = tl.arange(0, LA * LB // 16)
    ca = tl.cast(a_start + n * 7919, tl.uint32)
    cb = tl.cast(b_start + n * 104729, tl.uint32)
    ours = _philox_rounds(seed, ca, cb, tl.cast(c2, tl.uint32), tl.cast(c3, tl.uint32), 7)
    theirs = tl.philox(seed, ca, cb, tl.cast(c2, tl.uint32), tl.cast(c3, tl.uint32), 7)
    for w in tl.static_range(4):
        tl.store(WORDS + w * (LA * LB // 16) + n, ours[w].to(tl.int32, bitcast=True))
        tl.store(WORDS + (4 + w) * (LA * LB // 16) + n, theirs[w].to(tl.int32, bitcast=True))


def check_keep16(device: str, a_rows: bool) -> None:
    """Attention dropout's generator (``core_kernels._random.keep16``) against NumPy: element (a, b) of its
    tile is byte ``8 a3 + 4 b3 + 2 a0 + b0`` of Philox-4x32-7 with counter ``(a & ~9, b & ~9, c2, c3)``, kept
    when >= t; at counters near 2**31, through the interpreter ("cpu") or compiled ("cuda")."""
    import torch

    from flashbridge.core_kernels._loader import _InterpretedKernel
    from flashbridge.reference.random import philox4x32

    seed, la, lb, a0, b0, c2, c3, t = -123457, 32, 16, 2**31 - 64, 4096 + 48, 70001, 4099, 77
    out = torch.empty((la, lb) if a_rows else (lb, la), dtype=torch.int8, device=device)
    words = torch.empty(8, la * lb // 16, dtype=torch.int32, device=device)
    kernel = _keep16_probe if device != "cpu" else _InterpretedKernel(_keep16_probe.fn)
    kernel[(1,)](torch.tensor([seed], dtype=torch.int32, device=device), out, words, a0, b0, c2, c3, t, la, lb,
                 a_rows)
    a, b = np.ogrid[a0:a0 + la, b0:b0 + lb]
    byte = 8 * (a >> 3 & 1) + 4 * (b >> 3 & 1) + 2 * (a & 1) + (b & 1)
    draws = np.stack(philox4x32(seed, a & ~9, b & ~9, c2, c3, rounds=7), -1).astype("<u4").view(np.uint8)
    expected = np.take_along_axis(draws, byte[..., None], -1)[..., 0] >= t
    assert np.array_equal(out.cpu().numpy().astype(bool), expected if a_rows else expected.T)
    n = np.arange(la * lb // 16)
    want = philox4x32(seed, a0 + n * 7919, b0 + n * 104729, c2, c3, rounds=7)
    got = words.cpu().numpy().view(np.uint32)
    for w in range(4):
        assert np.array_equal(got[w], want[w]), f"keep16's Philox word {w}"
        assert np.array_equal(got[4 + w], want[w]), f"tl.philox word {w}"


def forward_with_config(q, k, v, kw, options, config):
    """The forward planned with an AttentionConfig (the public ops take none), run through the torch and the
    JAX runtime: (the plan, {"torch": (out, lse), "jax": (out, lse)})."""
    import torch

    from flashbridge.core_kernels.flash_attn.plan import check_attention_args, plan_attention_fwd
    from flashbridge.jax_api._runtime import execute as jax_execute
    from flashbridge.torch_api._runtime import dtype_name, execute, target_for

    tensors = {n: t for n, t in kw.items() if isinstance(t, torch.Tensor)}
    infos = {n: (tuple(t.shape), dtype_name(t.dtype)) for n, t in {"q": q, "k": k, "v": v, **tensors}.items()}
    sizes = {n: kw[n] for n in ("max_seqlen_q", "max_seqlen_k") if n in kw}
    shape, opts = check_attention_args(**infos, **sizes, **options)
    plan = plan_attention_fwd(shape, opts, target=target_for(q.device), config=config)
    inputs = {"q": q, "k": k, "v": v, **tensors}
    return plan, {"torch": execute(plan, inputs),
                  "jax": jax_execute(lambda t: plan_attention_fwd(shape, opts, target=t, config=config),
                                     {n: torch_to_jax(t) for n, t in inputs.items()})}


def backward_config_spy(monkeypatch) -> list:
    """The AttentionConfig active each time the torch dense attention backward plans (appended to the list
    returned): what a backward running on torch's autograd worker thread planned under."""
    from flashbridge.core_kernels._config import active_config
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig
    from flashbridge.torch_api import attention as attention_mod

    seen = []
    real = attention_mod.plan_attention_bwd

    def spy(*args, **kwargs):
        seen.append(active_config(AttentionConfig))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "plan_attention_bwd", spy)
    return seen


def odd_layouts(x) -> dict:
    """Views ``(B, S, H, D)`` whose last dimension is contiguous but whose other strides are not the
    contiguous ones, as an upstream op can hand a cotangent to attention's backward (a torch tensor ``x``
    gives the shape, the dtype and the values): ``x`` laid out as BHSD and transposed, ``x`` sliced out of
    a bigger tensor, and broadcasts (stride 0) over the heads and over the batch, which hold other values
    than ``x``. Compare each with its ``.contiguous()`` copy."""
    b, s, h, d = x.shape
    bigger = x.new_zeros(b, s + 3, h + 1, d)
    bigger[:, 2:2 + s, 1:] = x
    return {"bhsd-transposed": x.transpose(1, 2).contiguous().transpose(1, 2), "sliced": bigger[:, 2:2 + s, 1:],
            "expanded-over-heads": x[:, :, :1].expand(b, s, h, d), "expanded-over-batch": x[:1].expand(b, s, h, d)}


# ------------------------------------------------------------------------------------------------ decode

def make_decode_case(seed, *, b=3, sq=1, hq=4, hkv=2, dqk=64, dv=None, lens=(0, 1, 77), s_max=None, layout="NHD",
              page_size=None, dtype="float32", fp8=None, alibi=None, sinks=False, spare_pages=3):
    """Random decode inputs (never zeros) as torch CPU tensors. ``fp8``: None, "tensor" or "head" (an
    e4m3 cache holding ``x / scale``). Paged caches get a shuffled page pool with spare pages and -1 in the
    unused block-table entries (never read)."""
    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float8_e4m3fn": torch.float8_e4m3fn}
    g = torch.Generator().manual_seed(seed)
    dv = dv or dqk
    b = len(lens)
    s_max = s_max or max(max(lens), 1)
    dt = dtypes[dtype]
    kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32)}
    q = torch.randn(b, sq, hq, dqk, generator=g).to(dt)
    logical = [torch.randn(b, s_max, hkv, d, generator=g) for d in (dqk, dv)]  # (B, S, Hkv, D) float32
    if fp8 is not None:
        shape = (hkv,) if fp8 == "head" else ()
        scales = [torch.rand(shape, generator=g) * 0.5 + 0.25 for _ in range(2)]
        per = [s.reshape(-1) if s.dim() else s.reshape(1) for s in scales]
        logical = [(x / s[None, None, :, None] if fp8 == "head" else x / s).to(torch.float8_e4m3fn)
                   for x, s in zip(logical, per)]
        kw["k_scale"], kw["v_scale"] = scales
    else:
        logical = [x.to(dt) for x in logical]
    if page_size is None:
        caches = logical
    else:
        max_pages = -(-s_max // page_size)
        n_pages = b * max_pages + spare_pages
        perm = torch.randperm(n_pages, generator=g)
        table = torch.full((b, max_pages), -1, dtype=torch.int32)
        caches = []
        for x in logical:
            pool = torch.randn(n_pages, page_size, hkv, x.shape[-1], generator=g).to(x.dtype)
            for i in range(b):
                used = -(-lens[i] // page_size)
                for j in range(used):
                    page = int(perm[i * max_pages + j])
                    table[i, j] = page
                    rows = x[i, j * page_size:(j + 1) * page_size]
                    pool[page, :rows.shape[0]] = rows
            caches.append(pool)
        kw["block_table"] = table
    if layout == "HND":
        caches = [c.transpose(1, 2).contiguous() for c in caches]
    kw.update(score_mod_inputs(g, b, hq, alibi=alibi, sinks=sinks, slope_range=0.3))
    return q, caches[0], caches[1], kw



def run_generation_loops(k, v, lens, qs, k_new, v_new, *, num_splits=None, device=None):
    """The same generation loop both ways: in JAX inside one jitted call (``jax.lax.scan`` carrying the
    donated cache and the lengths; each step appends its token, then decodes over the grown cache), as the JAX
    decode docstring recommends, and in torch one step at a time. ``device``: where the JAX arrays go (JAX's
    default device otherwise). Returns ((k, v, lens, outs) of JAX, the same of torch)."""
    import warnings

    import jax
    import torch

    from flashbridge.jax_api import decode as ja
    from flashbridge.torch_api import decode as tapi

    def generate(kc, vc, lens, qs, k_new, v_new):
        def one_step(carry, xs):
            kc, vc, lens = carry
            q, kn, vn = xs
            kc, vc = ja.append_kv_cache(kc, vc, kn, vn, cache_seqlens=lens)
            out = ja.decode_attention(q, kc, vc, cache_seqlens=lens + 1, num_splits=num_splits)
            return (kc, vc, lens + 1), out

        (kc, vc, lens), outs = jax.lax.scan(one_step, (kc, vc, lens), (qs, k_new, v_new))
        return kc, vc, lens, outs

    args = [jax.device_put(torch_to_jax(x), device) for x in (k, v, lens, qs, k_new, v_new)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        jax_run = jax.jit(generate, donate_argnums=(0, 1))(*args)
    kc, vc, tlens, outs = k.clone(), v.clone(), lens.clone(), []
    for i in range(qs.shape[0]):
        tapi.append_kv_cache(kc, vc, k_new[i], v_new[i], cache_seqlens=tlens)
        tlens = tlens + 1
        outs.append(tapi.decode_attention(qs[i], kc, vc, cache_seqlens=tlens, num_splits=num_splits))
    return jax_run, (kc, vc, tlens, torch.stack(outs))


# --------------------------------------------------------------------------------------------------- MLA

def mla_sparse_indices(rng, batch, sq, sk, topk, *, causal=False, pad=0.25):
    """(B, Sq, topk) int32: distinct key positions per query (visible ones when causal), some entries -1
    (padding) and some past the sequence (skipped), in random order."""
    idx = np.full((batch, sq, topk), -1, dtype=np.int32)
    for b in range(batch):
        for i in range(sq):
            limit = i + sk - sq + 1 if causal else sk
            limit = max(limit, 0)
            n = min(topk, limit)
            chosen = rng.permutation(limit)[:n] if limit else np.zeros(0, dtype=np.int64)
            row = np.full(topk, -1, dtype=np.int64)
            row[:n] = chosen
            drop = rng.random(topk) < pad
            row[drop] = -1
            if topk > 2:
                row[-1] = sk + 3  # out of range: skipped
            idx[b, i] = rng.permutation(row)
    return idx



def naive_mla(q, kv, *, head_dim_v, causal=False, softmax_scale=None, indices=None, lengths=None, mask=None):
    """Absorbed MLA computed plainly in q's dtype (differentiable): the naive same-dtype implementation the
    tolerance is measured against; ``mask`` a dense bool (B|1, Sq, Sk) as reference.mla takes it. Returns
    (out, lse)."""
    import torch

    from flashbridge.reference import mla as ref

    b, sq, _, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    mask = torch.from_numpy(ref.visible(b, sq, kv.shape[1], causal=causal,
                                        indices=None if indices is None else np.asarray(indices.cpu()),
                                        lengths=lengths, mask=mask)).to(q.device)
    s = torch.einsum("bqhd,bkd->bhqk", q, kv) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    wide = s.to(torch.promote_types(s.dtype, torch.float32))  # bf16 scores softmax in float32, float64 stays
    lse = torch.logsumexp(wide, dim=-1)
    p = torch.nan_to_num(torch.softmax(wide, dim=-1)).to(q.dtype)
    return torch.einsum("bhqk,bkd->bqhd", p, kv[..., :head_dim_v]), lse



def assert_lse_close(lse, ref_lse, naive_lse, floor=1e-5):
    """The accuracy rule for a log-sum-exp: the same -inf pattern as the reference, the rule on the rest."""
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(np64(lse)), finite), "lse: -inf pattern differs from the reference"
    assert_close(np.where(finite, np64(lse), 0.0), np.where(finite, ref_lse, 0.0),
                 np.where(finite, np64(naive_lse), 0.0), name="lse", floor=floor)


# ---------------------------------------------------------------------------------------- ring attention

@dataclasses.dataclass(frozen=True)
class RingCase:
    """One ring attention problem; inputs are drawn from ``seed``, identical in every process."""

    world: int
    layout: str = "zigzag"
    causal: bool = False
    window: tuple = (-1, -1)
    hq: int = 2
    hkv: int = 2
    s_local: int = 16
    dim: int = 16
    batch: int = 1
    dtype: str = "float32"
    seed: int = 0

    @property
    def seqlen(self) -> int:
        return self.s_local * self.world

    def options(self) -> dict:
        return dict(causal=self.causal, window_size=self.window)

    def inputs(self):
        """Global (q, k, v, dout, dlse), never zeros."""
        import torch

        g = torch.Generator().manual_seed(self.seed)
        dt = getattr(torch, self.dtype)
        b, s, d = self.batch, self.seqlen, self.dim
        q = torch.randn(b, s, self.hq, d, generator=g).to(dt)
        k = torch.randn(b, s, self.hkv, d, generator=g).to(dt)
        v = torch.randn(b, s, self.hkv, d, generator=g).to(dt)
        dout = torch.randn(b, s, self.hq, d, generator=g).to(dt)
        dlse = torch.randn(b, self.hq, s, generator=g)
        return q, k, v, dout, dlse



RING_NAMES = ("out", "lse", "dq", "dk", "dv")



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def run_torch_ring_case(case: RingCase, rank: int, device) -> dict:
    """This rank's ring forward and backward for ``case`` (the process group is initialised)."""
    import torch

    from flashbridge.torch_api import ring_attention, sequence_shard

    q, k, v, dout, dlse = case.inputs()
    shard = lambda t, dim=1: sequence_shard(t, rank, case.world, layout=case.layout, dim=dim).to(device)  # noqa: E731
    leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention(*leaves, **case.options(), layout=case.layout, return_lse=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    ((out * shard(dout)).sum() + (lse * shard(dlse, 2)).sum()).backward()
    return {n: t.detach().cpu() for n, t in zip(RING_NAMES, (out, lse, *(x.grad for x in leaves)))}



def run_jax_ring_case(case: RingCase, devices):
    """The ring for ``case`` under shard_map over ``devices`` (one per rank), forward and backward in one
    jit; returns [out, lse, dq, dk, dv] in global order."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax.sharding import Mesh, PartitionSpec as P

    from flashbridge.jax_api import ring_attention, sequence_shard, sequence_unshard

    n = case.world
    q, k, v, dout, dlse = (torch_to_jax(t) for t in case.inputs())
    mesh = Mesh(np.array(devices[:n]), ("sp",))

    def layout(x, dim=1):  # the ranks' shards, concatenated: shard r lands on device r
        return jnp.concatenate([sequence_shard(x, r, n, layout=case.layout, dim=dim) for r in range(n)], axis=dim)

    seq, lse_spec = P(None, "sp"), P(None, None, "sp")
    ring = jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="sp", **case.options(), layout=case.layout,
                                       return_lse=True),
        mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, lse_spec))
    @jax.jit
    def forward_backward(q, k, v, dout, dlse):  # the forward runs once: its vjp is the ring backward
        (out, lse), vjp = jax.vjp(ring, q, k, v)
        return out, lse, *vjp((dout, dlse))

    out, lse, *grads = forward_backward(layout(q), layout(k), layout(v), layout(dout), layout(dlse, 2))
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    return [torch.from_numpy(np.array(sequence_unshard(a, n, layout=case.layout, dim=dim).astype(jnp.float32)))
            for a, dim in zip((out, lse, *grads), (1, 2, 1, 1, 1))]


# --------------------------------------------------- compiling a launch for sm_90 as each front-end does

TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
                 "float8_e4m3fn": "fp8e4nv"}



def sm90_backend():
    """(GPUTarget, backend) for sm_90, or skip."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(target.arch)  # raises when there is no usable ptxas
    except Exception as e:  # noqa: BLE001 - any missing piece means: cannot check here
        pytest.skip(f"no Triton NVIDIA backend / ptxas to compile for sm_90 on this machine: {e!r}")
    return target, backend



class _FakeTensor:
    """What Triton's launcher needs from a tensor argument: an aligned address and a dtype."""

    def __init__(self, dtype: str):
        self.dtype = TRITON_TYPES[dtype]

    @staticmethod
    def data_ptr() -> int:
        return 1 << 20



def _launch_options(launch) -> dict:
    return {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "enable_fp_fusion": True}



def compile_as_triton_launcher(launch, dtypes) -> str:
    return _triton_launcher_kernel(launch, dtypes).asm["ptx"]



def staged_buffers(launch, dtypes) -> list[tuple[int, ...]]:
    """The shapes of the shared-memory buffers Triton allocates for ``launch`` (sm_90, as its launcher
    specialises it), in program order: a pipelined load's buffer leads with its number of stages."""
    ttgir = _triton_launcher_kernel(launch, dtypes).asm["ttgir"]
    return [tuple(int(x) for x in m.split("x")) for m in
            re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([0-9x]+)x[a-z]", ttgir)]



def _triton_launcher_kernel(launch, dtypes):
    from triton._C.libtriton import native_specialize_impl  # noqa: F401 - the launcher's specialiser
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    target, backend = sm90_backend()
    fn = get_kernel(launch.kernel, False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = ([_FakeTensor(dtypes[n]) for n in launch.inputs] + launch.scalar_values()
            + [_FakeTensor(dtypes[n]) for n in launch.outputs])
    kwargs = {**launch.constexpr_dict(), **_launch_options(launch), "debug": False}
    if hasattr(triton.knobs.compilation, "instrumentation_mode"):
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)



def _jax_triton_type(v) -> str:
    if isinstance(v, bool):
        return "B"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    return "fp32"  # the JAX runtime passes every float scalar as np.float32



def compile_as_jax_triton(launch, dtypes) -> str:
    import triton._C.libtriton as libtriton
    from triton._C.libtriton import native_specialize_impl
    from triton.compiler import ASTSource
    from triton.compiler import code_generator

    _, backend = sm90_backend()
    fn = get_kernel(launch.kernel, False)
    scalars = launch.scalar_values()
    first = len(launch.inputs)
    arg_dtypes = (["*" + TRITON_TYPES[dtypes[n]] for n in launch.inputs] + [_jax_triton_type(v) for v in scalars]
                  + ["*" + TRITON_TYPES[dtypes[n]] for n in launch.outputs])
    signature = {fn.arg_names[i]: t for i, t in enumerate(arg_dtypes)}
    alignments = [0 if first <= i < first + len(scalars) else 16 for i in range(len(arg_dtypes))]
    specialization = [
        native_specialize_impl(backend, types.SimpleNamespace(data_ptr=lambda a=a: a, dtype=t.removeprefix("*")),
                               False, True, a > 0)
        for t, a in zip(arg_dtypes, alignments)]
    attrs = {(i,): backend.parse_attr(attr) for i, (_, attr) in enumerate(specialization)}
    constants = dict(launch.constexpr_dict())
    constants.update({fn.arg_names[first + j]: 1 for j, v in enumerate(scalars) if v == 1})
    for name in constants:
        signature[name] = "constexpr"
    options = backend.parse_options({**_launch_options(launch), "num_ctas": 1, "debug": False})
    context = libtriton.ir.context()
    libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = code_generator.ast_to_ttir(
        fn, ASTSource(fn, constexprs=constants, signature=signature, attrs=attrs), options=options,
        codegen_fns=backend.get_codegen_implementation(options), context=context,
        module_map=backend.get_module_map())
    metadata: dict = {}
    module = backend.make_ttir(module, metadata, options, 90)
    module = backend.make_ttgir(module, metadata, options, 90)
    llir = backend.make_llir(module, metadata, options, 90)
    return backend.make_ptx(llir, metadata, options, 90)



def _ptx_code(ptx: str) -> str:
    """The PTX without comments and debug information: ``.file`` lines and the debug sections name the
    source path, which differs between a compile and a hit in Triton's on-disk cache made from another
    checkout."""
    ptx = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines()
                     if line.strip() and not line.lstrip().startswith(("//", ".file")))



def assert_same_ptx(launch, dtypes) -> str:
    """The launch compiled both ways must give the same code; returns the launcher's whole PTX."""
    raw = compile_as_triton_launcher(launch, dtypes)
    a = _ptx_code(raw)
    b = _ptx_code(compile_as_jax_triton(launch, dtypes))
    if a != b:
        first = next(i for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())) if x != y)
        pytest.fail(f"{launch.kernel}: the two launchers compile different PTX; first difference at line "
                    f"{first}: {a.splitlines()[first]!r} vs {b.splitlines()[first]!r}")
    return raw



def assert_wgmma_pipelined(ptx: str, what: str) -> None:
    """ptxas may serialise every wgmma of a kernel (a wait after each one: warning C7515, "wgmma.mma_async
    instructions are serialized due to non wgmma instructions defining accumulator registers") -- same
    results, a fraction of the speed, which no value test can see. Found at compile time when the causal
    backward's masked dK/dV segments took 32-row query blocks inside 64-row tiles (sm_90, Triton 3.6)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = f"{tmp}/kernel.ptx"
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([get_ptxas(90).path, "--gpu-name=sm_90a", src, "-o", f"{tmp}/kernel.cubin"],
                             capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "C7515" not in run.stdout + run.stderr, f"{what}: ptxas serialises its wgmma: {run.stdout + run.stderr}"



def vector_loads(ptx: str) -> int:
    return len(re.findall(r"ld\.global[^\n]*\.v4|cp\.async\.cg\.shared\.global[^\n]*0x10", ptx))



# ------------------------------------------------------------------------------- attention over a key cache

def make_paged_prefill_case(seed, *, lens_q=(5, 17, 1), used=(40, 17, 3), hq=4, hkv=2, dqk=32, dv=None,
                            page_size=16, spare_pages=5, extra_capacity=1, dtype="float32", device="cpu",
                            packed_q=True):
    """A chunked-prefill case: sequence b has ``lens_q[b]`` queries and uses ``used[b]`` keys of a paged
    cache ``(num_pages, page_size, Hkv, D)``, its pages a shuffled draw from a pool with ``spare_pages`` pages
    no table names, the table ``extra_capacity`` pages wider than the longest sequence needs (those entries
    -1: never read). Every slot not holding a used key -- rows past ``used[b]``, spare pages -- is NaN, so a
    read of one shows in the output. Returns a dict: q, k_cache, v_cache, block_table, seqused_k,
    cu_seqlens_q (packed_q), max_seqlen_q, and the same keys gathered: k, v packed with cu_seqlens_k."""
    import torch

    dt = getattr(torch, dtype)
    dv = dv or dqk
    g = torch.Generator().manual_seed(seed)
    batch = len(lens_q)
    pages_per = [-(-u // page_size) for u in used]
    width = max(max(pages_per), 1) + extra_capacity
    num_pages = sum(pages_per) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((batch, width), -1, dtype=torch.int32)
    k_cache = torch.full((num_pages, page_size, hkv, dqk), float("nan"), dtype=dt)
    v_cache = torch.full((num_pages, page_size, hkv, dv), float("nan"), dtype=dt)
    ks, vs = [], []
    for b, u in enumerate(used):
        pages = [perm.pop() for _ in range(pages_per[b])]
        table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        kk = torch.randn(u, hkv, dqk, generator=g).to(dt)
        vv = torch.randn(u, hkv, dv, generator=g).to(dt)
        for j in range(u):
            k_cache[pages[j // page_size], j % page_size] = kk[j]
            v_cache[pages[j // page_size], j % page_size] = vv[j]
        ks.append(kk)
        vs.append(vv)
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(used)], dtype=torch.int32)
    if packed_q:
        q = torch.randn(int(cu_q[-1]), hq, dqk, generator=g).to(dt)
    else:
        assert len(set(lens_q)) == 1
        q = torch.randn(batch, lens_q[0], hq, dqk, generator=g).to(dt)
    case = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table,
            "seqused_k": torch.tensor(used, dtype=torch.int32), "cu_seqlens_q": cu_q if packed_q else None,
            "max_seqlen_q": max(lens_q) if packed_q else None, "k": torch.cat(ks), "v": torch.cat(vs),
            "cu_seqlens_k": cu_k, "cu_seqlens_q_ref": cu_q}
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in case.items()}


# ------------------------------------------------------------------------------------ JAX eager vs jit

JAX_HOST_FAMILIES = ("norms", "attention", "block_sparse", "decode", "mla", "cross_entropy", "rotary", "swiglu")


def jax_host_cases(dtype: str = "float32") -> dict:
    """Small calls of an op of every family on JAX's default device: family -> (op, arrays, cotangent or
    None); ``op(*arrays)`` is the call, with a cotangent its vjp too (test_host_cost[_gpu].py)."""
    import jax
    import jax.numpy as jnp

    from flashbridge import jax_api as fj
    from flashbridge import masks

    keys = iter(jax.random.split(jax.random.key(0), 40))
    dt = jnp.dtype(dtype)

    def rnd(*shape, dtype=dt):
        return jax.random.normal(next(keys), shape, dtype)

    x, w, b = rnd(6, 40), rnd(40), rnd(40)
    q, k, v = rnd(1, 9, 2, 16), rnd(1, 11, 2, 16), rnd(1, 11, 2, 16)
    qs, ks, vs = rnd(1, 32, 2, 16), rnd(1, 32, 2, 16), rnd(1, 32, 2, 16)
    mask = fj.mask_to_device(masks.document([12, 20], block_size=16))
    qd, kc, vc, kn = rnd(2, 1, 4, 16), rnd(2, 20, 2, 16), rnd(2, 20, 2, 16), rnd(2, 1, 2, 16)
    lens = jnp.array([20, 7], jnp.int32)
    qm, kvm = rnd(1, 16, 2, 96), rnd(1, 16, 96)
    logits, labels = rnd(5, 37), jnp.array([0, 3, 36, -100, 5], jnp.int32)
    h, wv = rnd(5, 16), rnd(37, 16)
    xr, cos, sin = rnd(1, 12, 2, 16), rnd(12, 8, dtype=jnp.float32), rnd(12, 8, dtype=jnp.float32)
    g, u = rnd(4, 24), rnd(4, 24)
    one = jnp.float32(1.0)
    return {
        "norms": (lambda x, w, b, r: fj.layer_norm_dropout_residual(x, w, b, r, dropout_p=0.25, seed=7),
                  (x, w, b, rnd(6, 40)), rnd(6, 40)),
        "attention": (lambda q, k, v: fj.flash_attention(q, k, v, causal=True), (q, k, v), rnd(1, 9, 2, 16)),
        "block_sparse": (lambda q, k, v: fj.flash_attention(q, k, v, block_mask=mask), (qs, ks, vs),
                         rnd(1, 32, 2, 16)),
        "decode": (lambda q, kc, vc, kn, n: (fj.decode_attention(q, kc, vc, cache_seqlens=n, num_splits=2),
                                             *fj.append_kv_cache(kc, vc, kn, kn, cache_seqlens=n - 1)),
                   (qd, kc, vc, kn, lens), None),
        "mla": (lambda q, kv: fj.mla_attention(q, kv, head_dim_v=64, causal=True), (qm, kvm), rnd(1, 16, 2, 64)),
        "cross_entropy": (lambda x, h, w: (fj.cross_entropy(x, labels, z_loss=1e-3),
                                           fj.linear_cross_entropy(h, w, labels, chunk_size=4)),
                          (logits, h, wv), (one, 0.5 * one)),
        "rotary": (lambda x: fj.rotary_embedding(x, cos, sin), (xr,), rnd(1, 12, 2, 16)),
        "swiglu": (lambda g, u: fj.swiglu(g, u), (g, u), rnd(4, 24)),
    }


def assert_jax_eager_matches_jit(op, arrays, cotangent, *, name: str) -> None:
    """``op(*arrays)`` called eagerly and inside ``jax.jit`` give the same bits; with a cotangent, its vjp
    too."""
    import jax

    def same(a, b):
        leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
        assert len(leaves_a) == len(leaves_b) > 0
        for x, y in zip(leaves_a, leaves_b):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(np.asarray(x.astype("float32") if x.dtype == "bfloat16" else x),
                                  np.asarray(y.astype("float32") if y.dtype == "bfloat16" else y),
                                  equal_nan=True), name

    same(op(*arrays), jax.jit(op)(*arrays))
    if cotangent is not None:
        def grads(*a):
            return jax.vjp(op, *a)[1](cotangent)

        same(grads(*arrays), jax.jit(grads)(*arrays))
