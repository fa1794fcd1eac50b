"""FP8 (e4m3fn) edges on a CUDA GPU, both frameworks (skipped without a GPU): ``append_kv_cache`` stores NaN
as e4m3fn's NaN and saturates +-inf to +-448 through the compiled kernel, with the same bytes as the CPU
interpreter and as ml_dtypes."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import e4m3_bits_expected, torch_to_jax

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")
E4M3 = torch.float8_e4m3fn


def _case(dtype, scale_mode, paged):
    """k_new / v_new (4, 5, 8, 128) in ``dtype`` with NaN, -NaN, +-inf, out-of-range and ordinary values,
    a cache of 64 rows per sequence (paged: 16-row pages in a shuffled pool), lengths before the append."""
    g = torch.Generator().manual_seed(7)
    shape = (4, 5, 8, 128)
    vals = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    flat = vals.view(-1)
    pick = torch.randperm(flat.numel(), generator=g)
    for i, special in enumerate((NAN, -NAN, INF, -INF, 1e30, -1e30)):
        flat[pick[i * 97:(i + 1) * 97]] = special
    k_new, v_new = vals.to(dtype), vals.flip(-1).to(dtype)
    lens = torch.tensor([0, 17, 40, 59], dtype=torch.int32)
    scales = {}
    if scale_mode == "head":
        scales = {"k_scale": torch.rand(8, generator=g) + 0.25, "v_scale": torch.rand(8, generator=g) + 0.25}
    elif scale_mode == "tensor":
        scales = {"k_scale": torch.tensor(0.375), "v_scale": torch.tensor(1.5)}
    extra = {}
    if paged:
        extra["block_table"] = torch.randperm(20, generator=g)[:16].reshape(4, 4).to(torch.int32)
        cache_shape = (20, 16, 8, 128)
    else:
        cache_shape = (4, 64, 8, 128)
    return k_new, v_new, lens, scales, extra, cache_shape


def _expected(new, scale, scale_mode):
    x = new.float().numpy()
    if scale_mode == "head":
        x = x / scale.numpy()[None, None, :, None]
    elif scale_mode == "tensor":
        x = x / np.float32(scale)
    return e4m3_bits_expected(x)


def _rows(cache, lens, n_new, block_table):
    """The appended rows (B, S_new, Hkv, D) of a cache, as bytes."""
    c = cache.view(torch.uint8).cpu()
    out = []
    for b, start in enumerate(lens.tolist()):
        pos = torch.arange(start, start + n_new)
        if block_table is None:
            out.append(c[b, pos])
        else:
            out.append(c[block_table[b, pos // c.shape[1]].long(), pos % c.shape[1]])
    return torch.stack(out).numpy()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("scale_mode", ["none", "tensor", "head"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_append_stores_nan_and_saturates_inf(dtype, scale_mode, paged):
    from flashbridge.torch_api.decode import append_kv_cache

    k_new, v_new, lens, scales, extra, cache_shape = _case(getattr(torch, dtype), scale_mode, paged)
    table = extra.get("block_table")
    caches = {}
    for device in ("cuda", "cpu"):
        kc, vc = (torch.zeros(cache_shape, dtype=E4M3, device=device) for _ in range(2))
        append_kv_cache(kc, vc, k_new.to(device), v_new.to(device), cache_seqlens=lens.to(device),
                        **{n: t.to(device) for n, t in {**scales, **extra}.items()})
        caches[device] = (kc.cpu(), vc.cpu())
    for i, (name, new) in enumerate((("k", k_new), ("v", v_new))):
        got = caches["cuda"][i]
        want = _expected(new, scales.get(f"{name}_scale"), scale_mode)
        np.testing.assert_array_equal(_rows(got, lens, 5, table), want, err_msg=f"{name}: GPU bytes")
        # the CPU interpreter stores the same bytes, and nothing outside the appended rows is touched
        np.testing.assert_array_equal(got.view(torch.uint8).numpy(), caches["cpu"][i].view(torch.uint8).numpy())
        assert int((got.view(torch.uint8) != 0).sum()) <= np.count_nonzero(want)
        assert torch.isnan(got.float()).sum() == 2 * 97  # NaN and -NaN, none made up, none lost

    # JAX on the GPU: the same bytes
    jax = pytest.importorskip("jax")
    from flashbridge.jax_api.decode import append_kv_cache as jappend

    dev = jax.devices("gpu")[0]
    put = lambda t: jax.device_put(torch_to_jax(t), dev)  # noqa: E731
    zeros = torch.zeros(cache_shape, dtype=E4M3)
    jk, jv = jappend(put(zeros), put(zeros), put(k_new), put(v_new), cache_seqlens=put(lens),
                     **{n: put(t) for n, t in {**scales, **extra}.items()})
    for i, arr in enumerate((jk, jv)):
        np.testing.assert_array_equal(np.asarray(arr).view(np.uint8), caches["cuda"][i].view(torch.uint8).numpy())
