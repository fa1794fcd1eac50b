"""Edge inputs of flash_attention, both frameworks, CPU (Triton's interpreter).

* Non-finite values follow IEEE arithmetic exactly as the float64 reference does: NaN in anything a row sees
  gives that row NaN in ``out`` and (unless only a value holds it) in ``lse``; +inf scores and sinks give
  lse +inf. Compared element class by element class (NaN, +inf, -inf, finite) with the reference.
* Keys a row does not see never reach it, whatever they hold: other packed sequences, padded head-dim
  columns of strided views, masked keys' NaN keys, key tiles outside the row's window.
* Invalid packed offsets under ``jax.jit`` / ``torch.compile`` (not checked on the host): every row of
  out, lse, dq, dk, dv is written -- NaN where no sequence covers it -- never left as it was.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flashbridge.core_kernels._config import configure
from flashbridge.core_kernels._poison import poison_buffers
from flashbridge.core_kernels.flash_attn.plan import AttentionConfig
from flashbridge.jax_api import flash_attention as jax_flash_attention
from flashbridge.reference import attention as ref
from flashbridge.torch_api import flash_attention as torch_flash_attention
from helpers import assert_same_values

NAN, INF = float("nan"), float("inf")


def _run(framework, q, k, v, **kw):
    """(out, lse) as float64 NumPy arrays from the given framework; inputs are NumPy arrays."""
    if framework == "torch":
        conv = {n: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
        out, lse = torch_flash_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                         return_lse=True, **conv)
        return out.double().numpy(), lse.double().numpy()
    conv = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kw.items()}
    out, lse = jax_flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), return_lse=True, **conv)
    return np.asarray(out, np.float64), np.asarray(lse, np.float64)




def _inputs(rng, b=1, s=80, h=2, hkv=None, d=16):
    hkv = hkv or h
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    return q, k, v


# Each case edits (q, k, v, extra kwargs); 80 tokens = two 64-row tiles of the interpreter plans.
CASES = {
    "q_nan": lambda q, k, v, kw: q.__setitem__((0, 3, 1, 0), NAN),
    "k_nan_visible_to_later_rows": lambda q, k, v, kw: k.__setitem__((0, 5, 0, 0), NAN),
    "k_nan_second_tile": lambda q, k, v, kw: k.__setitem__((0, 70, 1, 2), NAN),
    "v_nan_seen_by_every_row": lambda q, k, v, kw: v.__setitem__((0, 0, 1, 2), NAN),
    "k_row_of_neg_inf": lambda q, k, v, kw: k.__setitem__((0, 4, 0), -INF),
    "alibi_slope_nan": lambda q, k, v, kw: kw.update(alibi_slopes=np.array([NAN, 0.3], np.float32)),
    "sink_nan": lambda q, k, v, kw: kw.update(sinks=np.array([0.5, NAN], np.float32)),
    "sink_pos_inf": lambda q, k, v, kw: kw.update(sinks=np.array([INF, 0.5], np.float32)),
    "sink_neg_inf": lambda q, k, v, kw: kw.update(sinks=np.array([-INF, 0.5], np.float32)),
    "q_pos_inf": lambda q, k, v, kw: q.__setitem__((0, 3, 1, 0), INF),
    "q_pos_inf_and_k_nan": lambda q, k, v, kw: (q.__setitem__((0, 10, 1, 0), INF),
                                                 k.__setitem__((0, 2, 1, 3), NAN)),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_nonfinite_values_follow_the_reference(framework, case):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, k, v = _inputs(rng)
    kw = {}
    CASES[case](q, k, v, kw)
    out, lse = _run(framework, q, k, v, causal=True, **kw)
    want_out, want_lse = ref.flash_attention(q, k, v, causal=True, **kw)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_nan_row_has_nan_lse_not_neg_inf(framework):
    """The issue's examples: NaN in q[0, 3, 1, 0] or k[0, 5, 0, 0] gave lse -inf (read as "saw nothing")."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, s=20)
    q[0, 3, 1, 0] = NAN
    k[0, 5, 0, 0] = NAN
    out, lse = _run(framework, q, k, v)
    assert np.isnan(lse[0, 1, 3]) and np.isnan(out[0, 3, 1]).all()
    assert np.isnan(lse[0, 0]).all() and np.isnan(out[0, :, 0]).all()  # every row sees key 5 (not causal)
    assert np.isfinite(lse[0, 1, :3]).all() and np.isfinite(out[0, :3, 1]).all()
    assert not np.isneginf(lse).any()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_other_packed_sequences_never_contaminate(framework):
    """Sequence 1 is NaN throughout (q, k, v): sequences 0 and 2 are exact; sequence 1 is NaN."""
    rng = np.random.default_rng(4)
    cu = np.array([0, 30, 47, 90], np.int32)
    q, k, v = (rng.standard_normal((90, 2, 16)).astype(np.float32) for _ in range(3))
    for a in (q, k, v):
        a[30:47] = NAN
    out, lse = _run(framework, q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=43,
                    max_seqlen_k=43)
    want_out, want_lse = ref.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert_same_values(out, want_out, "out")
    assert_same_values(lse, want_lse, "lse")
    assert np.isfinite(out[:30]).all() and np.isfinite(out[47:]).all() and np.isnan(out[30:47]).all()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_padded_columns_and_unseen_keys_never_contaminate(framework):
    """Strided views whose padding columns are NaN (head dims 20 of 32), NaN keys and values past a sliding
    window's reach, and NaN keys (not values) that causal rows do not see: every row stays finite."""
    rng = np.random.default_rng(5)
    s, d = 150, 20
    full = [rng.standard_normal((1, s, 2, 32)).astype(np.float32) for _ in range(3)]
    for a in full:
        a[..., d:] = NAN
    full[1][0, 130:] = NAN  # keys 130.. are outside every window of rows < 64 (their tile reaches key 63)
    full[2][0, 130:] = NAN
    full[1][0, 100, 0] = NAN  # a key NaN (not its value): rows before 100 do not see it
    if framework == "torch":
        q, k, v = (torch.from_numpy(a)[..., :d] for a in full)
        out, lse = torch_flash_attention(q, k, v, causal=True, window_size=(8, 0), return_lse=True)
        out, lse = out.double().numpy(), lse.double().numpy()
    else:
        q, k, v = (jnp.asarray(a)[..., :d] for a in full)
        out, lse = jax_flash_attention(q, k, v, causal=True, window_size=(8, 0), return_lse=True)
        out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    want_out, want_lse = ref.flash_attention(*(a[..., :d] for a in full), causal=True, window_size=(8, 0))
    assert np.isfinite(out[0, :64]).all() and np.isfinite(lse[0, :, :100]).all()
    assert np.isfinite(out[0, :100, 1]).all()
    assert_same_values(lse, want_lse, "lse")
    rows = np.r_[0:64]
    assert_same_values(out[0, rows], want_out[0, rows], "out")


# ----------------------------------------------------------------------------- invalid offsets under jit

def _uncovered(cu, max_len, total):
    """Rows no sequence's program covers, from the kernels' clamping rule (seq_range)."""
    covered = np.zeros(total, bool)
    for b in range(len(cu) - 1):
        start = min(max(int(cu[b]), 0), total)
        end = min(max(int(cu[b + 1]), start), total)
        covered[start:start + min(end - start, max_len)] = True
    return ~covered


BAD_OFFSETS = {  # (cu_seqlens, max_seqlen): the packed length is 40
    "valid": ([0, 10, 25, 40], 16),
    "not_monotone": ([0, 30, 10, 40], 16),
    "last_below_total": ([0, 10, 25, 33], 16),
    "last_above_total": ([0, 10, 50, 60], 16),
    "first_not_zero": ([5, 10, 25, 40], 16),
    "max_seqlen_too_small": ([0, 10, 30, 40], 16),
}


def _packed(seed=6, total=40, h=2, d=16):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((total, h, d)).astype(np.float32) for _ in range(4))


@pytest.mark.parametrize("case", sorted(BAD_OFFSETS))
@pytest.mark.thin(3)
def test_invalid_offsets_under_jax_jit_write_every_row(case):
    cu, max_len = BAD_OFFSETS[case]
    cu = np.array(cu, np.int32)
    q, k, v, dout = _packed()
    lost = _uncovered(cu, max_len, len(q))
    assert lost.any() == (case != "valid")

    def loss(q, k, v, cu):
        out, lse = jax_flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                       max_seqlen_k=max_len, return_lse=True)
        return jnp.sum(out * dout), (out, lse)

    for config in (AttentionConfig(fused_backward=True), AttentionConfig(fused_backward=False),
                   AttentionConfig(interleave_backward=True)):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))  # traced under the config
        with configure(config), poison_buffers(7.0):  # unwritten elements would read 7
            (_, (out, lse)), grads = step(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cu)
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[lost]).all() and np.isnan(lse[:, lost]).all()
        assert np.isfinite(out[~lost]).all() and np.isfinite(lse[:, ~lost]).all()
        for name, g in zip(("dq", "dk", "dv"), grads):
            g = np.asarray(g)
            assert np.isnan(g[lost]).all(), name
            assert np.isfinite(g[~lost]).all(), name


@pytest.mark.parametrize("case", ["not_monotone", "last_below_total", "max_seqlen_too_small"])
def test_invalid_offsets_under_torch_compile_write_every_row(case):
    cu, max_len = BAD_OFFSETS[case]
    q, k, v, _ = (torch.from_numpy(a) for a in _packed())
    cu = torch.tensor(cu, dtype=torch.int32)
    lost = torch.from_numpy(_uncovered(cu.numpy(), max_len, len(q)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, k, v, cu):
        return torch_flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                     max_seqlen_k=max_len, return_lse=True)

    with poison_buffers(7.0):
        out, lse = f(q, k, v, cu)
    assert out[lost].isnan().all() and lse[:, lost].isnan().all()
    assert out[~lost].isfinite().all() and lse[:, ~lost].isfinite().all()


def test_invalid_offsets_are_still_refused_eagerly():
    q, k, v, _ = (torch.from_numpy(a) for a in _packed())
    cu = torch.tensor([0, 30, 10, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        torch_flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30, max_seqlen_k=30)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        jax_flash_attention(jnp.asarray(q.numpy()), jnp.asarray(k.numpy()), jnp.asarray(v.numpy()),
                            cu_seqlens_q=jnp.asarray(cu.numpy()), cu_seqlens_k=jnp.asarray(cu.numpy()),
                            max_seqlen_q=30, max_seqlen_k=30)


# ---------------------------------------------------------------------- checkify validation under jit

def test_checkify_validates_offsets_under_jit():
    from jax.experimental import checkify

    from flashbridge.jax_api import checks

    q, k, v, _ = (jnp.asarray(a) for a in _packed())

    def step(q, k, v, cu):
        checks.cu_seqlens(cu, total=q.shape[0], max_seqlen=16, name="cu_seqlens_q")
        return jax_flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16)

    checked = checkify.checkify(jax.jit(step))
    err, out = checked(q, k, v, jnp.array([0, 10, 25, 40], jnp.int32))
    err.throw()  # valid: nothing to report
    assert np.isfinite(np.asarray(out)).all()
    for cu, message in (([0, 30, 10, 40], "cu_seqlens_q: must be non-decreasing"),
                        ([0, 10, 25, 33], r"cu_seqlens_q: the last offset \(33\)"),
                        ([3, 10, 25, 40], "cu_seqlens_q: must start at 0"),
                        ([0, 10, 30, 40], r"max_seqlen for cu_seqlens_q: 16 is smaller than the longest "
                                          r"sequence \(20\)")):
        err, _ = checked(q, k, v, jnp.array(cu, jnp.int32))
        with pytest.raises(Exception, match=message):
            err.throw()


def test_checkify_validates_cache_lengths_page_tables_and_labels_under_jit():
    from jax.experimental import checkify

    from flashbridge.jax_api import checks

    @jax.jit
    def f(lengths, table, labels):
        checks.cache_seqlens(lengths, capacity=64, n_new=2)
        checks.block_table(table, num_pages=8, cache_seqlens=lengths, page_size=16, n_new=2)
        checks.labels(labels, vocab=100)
        return lengths + 1

    checked = checkify.checkify(f)
    lengths, table = jnp.array([5, 40], jnp.int32), jnp.array([[0, -1, -1, -1], [1, 2, 3, -1]], jnp.int32)
    labels = jnp.array([3, -100, 99], jnp.int32)
    checked(lengths, table, labels)[0].throw()  # valid (the -1 entries are past each sequence's pages)
    bad = ((jnp.array([5, 63], jnp.int32), table, labels, "cache_seqlens: 63 \\(\\+ 2 new tokens\\) exceeds"),
           (jnp.array([-1, 40], jnp.int32), table, labels, "cache_seqlens: must be >= 0"),
           (lengths, table.at[1, 2].set(8), labels, r"block_table: page ids must be in \[0, 8\); entry 6 holds 8"),
           (lengths, table, labels.at[2].set(100), r"labels: must be in \[0, 100\) or -100; position 2 holds 100"))
    for lengths_, table_, labels_, message in bad:
        err, _ = checked(lengths_, table_, labels_)
        with pytest.raises(Exception, match=message):
            err.throw()
