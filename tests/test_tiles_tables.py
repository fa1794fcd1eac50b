"""The shipped H200 tile entries reproduce the tables the plans carried in their source before the tiles
moved to data (``flashbridge/tiles/data/tiles.json``): for every shape class those tables covered, a plan
built for the H200 (``Target(interpret=False, num_sms=132)``, no user cache) takes the same tile as before.

The expected values below are those tables, copied verbatim (attention: ``GPU_TILES`` / ``GPU_TILES_FP32``;
decode: ``GPU_DECODE_TILES`` by case; norms and cross-entropy: their tile formulas).
"""
from __future__ import annotations

import pytest

from flashbridge.core_kernels._plan import Target, cdiv, next_power_of_2
from flashbridge.core_kernels.cross_entropy.plan import CEConfig, plan_ce_fwd
from flashbridge.core_kernels.decode import plan as dp
from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                      plan_attention_fwd)
from flashbridge.core_kernels.norms.plan import NormConfig, plan_norm_bwd, plan_norm_fwd

H200 = Target(interpret=False, num_sms=132)
SWEPT = "H200 steady sweep"  # the source of entries a tuning sweep added over the tables' own


@pytest.fixture(autouse=True)
def table_entries_only(tmp_path, monkeypatch):
    """The shipped file as the tables became, before a tuning sweep changed entries (added length-bucketed
    ones, checked by :func:`test_swept_entries_override_only_their_length_bucket`, or replaced a table's
    tile, kept as ``table_tile``)."""
    from flashbridge.tiles import cache

    entries = {}
    for k, v in cache.read_entries(cache.shipped_file()).items():
        if SWEPT not in str(v.get("source", "")):
            entries[k] = v
        elif "table_tile" in v:  # a sweep replaced the table's tile for this bucket
            entries[k] = {**v, "tile": v["table_tile"]}
    path = tmp_path / cache.FILE_NAME
    path.write_text(cache.dumps(entries))
    monkeypatch.setattr(cache, "shipped_file", lambda: path)

OLD_GPU_TILES = {
    64: {"fwd": (128, 64, 8, 3), "fwd_masked": (64, 64, 4, 3), "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3)},
    128: {"fwd": (128, 128, 8, 3), "fwd_masked": (128, 128, 8, 3), "dkdv": (64, 128, 8, 3),
          "dkdv_gqa_causal": (32, 128, 8, 3), "dq": (128, 64, 8, 4)},
    256: {"fwd": (128, 64, 8, 2), "fwd_masked": (128, 64, 8, 2), "dkdv": (32, 32, 4, 2),
          "dkdv_split": (32, 128, 8, 2), "dq": (128, 32, 8, 2)},
}
OLD_GPU_TILES_FP32 = {
    128: {"fwd": (32, 32, 8, 2), "fwd_masked": (32, 32, 8, 2), "dkdv": (16, 32, 4, 2), "dq": (32, 32, 8, 2)},
    256: {"fwd": (32, 32, 8, 2), "fwd_masked": (32, 32, 8, 2), "dkdv": (16, 16, 4, 2), "dq": (32, 32, 8, 2)},
}
OLD_DECODE_TILES = {  # (block_m, block_n, num_warps, num_stages, programs_per_sm)
    "narrow": (64, 64, 4, 3, 0), "wide": (64, 32, 8, 3, 0), "wide_v": (32, 32, 8, 3, 0),
    "float32": (16, 32, 8, 2, 0), "fp8": (64, 128, 4, 3, 0), "fp8_one_per_sm": (64, 256, 4, 3, 1),
    "idle_contiguous": (64, 128, 4, 3, 1), "idle_paged": (64, 64, 4, 5, 2),
}


def _old_attn(entry: str, d: int, dtype: str):
    d = max(16, next_power_of_2(d))
    if dtype == "float32":
        per = OLD_GPU_TILES_FP32[128 if d <= 128 else 256]
    else:
        per = OLD_GPU_TILES[64 if d <= 64 else 128 if d <= 128 else 256]
    return per.get(entry) or per[entry.split("_")[0]]


def _tile(launch, m="BLOCK_M", n="BLOCK_N"):
    c = launch.constexpr_dict()
    return (c[m], c[n], launch.num_warps, launch.num_stages)


ATTN_CASES = [(d, dv, dtype, kind, group, s)
              for dtype in ("bfloat16", "float16", "float32")
              for d, dv in ((16, 16), (32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256), (64, 256))
              for kind in ("full", "causal", "local")
              for group in (1, 4)
              for s in (1000, 4096, 100_000)
              if not (dtype == "float32" and d < 64)]


@pytest.mark.parametrize("d,dv,dtype,kind,group,s", ATTN_CASES)
def test_attention_tiles_match_the_old_tables(d, dv, dtype, kind, group, s):
    hq = 8
    q = ((1, s, hq, d), dtype)
    k = ((1, s, hq // group, d), dtype)
    v = ((1, s, hq // group, dv), dtype)
    shape, options = check_attention_args(q=q, k=k, v=v, causal=kind == "causal",
                                          window_size=(128, 0) if kind == "local" else (-1, -1))
    widest = max(d, dv)
    fwd = plan_attention_fwd(shape, options, target=H200).launches[0]
    assert _tile(fwd) == _old_attn("fwd" if kind == "full" else "fwd_masked", widest, dtype)
    bwd = plan_attention_bwd(shape, options, target=H200, config=AttentionConfig(fused_backward=False))
    dkdv = next(l for l in bwd.launches if l.kernel.endswith("attn_bwd_dkdv_kernel"))
    dq = next(l for l in bwd.launches if l.kernel.endswith("attn_bwd_dq_kernel"))
    split = dict(dkdv.constexprs).get("COL_SPLIT", 1)
    entry = ("dkdv_split" if split > 1 and dtype != "float32" and widest > 128 else
             "dkdv_gqa_causal" if group > 1 and kind == "causal" else "dkdv")
    assert _tile(dkdv) == _old_attn(entry, widest, dtype)
    assert _tile(dq) == _old_attn("dq", widest, dtype)


def test_swept_entries_override_only_their_length_bucket(monkeypatch):
    """A swept entry (D=128 full forward, keys up to 1k) moves that bucket's tile and no other length's."""
    from flashbridge.tiles import cache

    monkeypatch.undo()  # the real shipped file
    swept = {k: v for k, v in cache.read_entries(cache.shipped_file()).items() if SWEPT in str(v.get("source", ""))}
    key = "H200|sm90|triton 3.6.0|attention_fwd|d128-bfloat16-full-mha-s1k"
    assert key in swept
    for s, expected in ((1000, tuple(swept[key]["tile"])), (4096, _old_attn("fwd", 128, "bfloat16"))):
        q = ((1, s, 8, 128), "bfloat16")
        shape, options = check_attention_args(q=q, k=q, v=q)
        assert _tile(plan_attention_fwd(shape, options, target=H200).launches[0]) == expected, s


def test_attention_config_fields_still_win():
    shape, options = check_attention_args(q=((1, 512, 4, 64), "bfloat16"), k=((1, 512, 4, 64), "bfloat16"),
                                          v=((1, 512, 4, 64), "bfloat16"))
    config = AttentionConfig(block_n=32, num_stages=2)
    fwd = plan_attention_fwd(shape, options, target=H200, config=config).launches[0]
    assert _tile(fwd) == (128, 32, 8, 2)


DECODE_CASES = [(rows, d, dv, dtype, cache_dtype, paged, page, bh, span)
                for rows in (1, 4, 16, 32)
                for d, dv in ((64, 64), (128, 128), (256, 256), (576, 512))
                for dtype in ("bfloat16", "float32")
                for cache_dtype in ("same", "float8_e4m3fn")
                for paged, page in ((False, 0), (True, 64), (True, 128), (True, 16))
                for bh in (None, 8, 256)
                for span in (None, 4096, 131072)
                if not (cache_dtype != "same" and dtype == "float32")]


@pytest.mark.parametrize("rows,d,dv,dtype,cache_dtype,paged,page,bh,span", DECODE_CASES)
def test_decode_tiles_match_the_old_table(rows, d, dv, dtype, cache_dtype, paged, page, bh, span):
    cdt = dtype if cache_dtype == "same" else cache_dtype
    cache = dp.CacheShape("NHD", paged, 64 if paged else 2, page or (span or 4096), 64 if paged else 1, 8,
                          d, dv, cdt)
    got = dp.decode_tiles(rows, d, dv, H200, dp.DecodeConfig(), dtype, cache=cache, batch_heads=bh, span=span)
    block_dqk = max(16, next_power_of_2(d)) if d <= 256 else 64
    chunks = 1 if d <= 256 else cdiv(d, 64)
    block_dv = max(16, next_power_of_2(dv))
    case = dp._gpu_case(rows, max(block_dqk * chunks, block_dv), block_dv, dtype, cache, bh, span, H200)
    m, n, w, st, per_sm = OLD_DECODE_TILES[case]
    assert (got.block_m, got.block_n, got.num_warps, got.num_stages, got.programs_per_sm) == (
        min(m, max(16, next_power_of_2(rows))), n, w, st, per_sm), case


@pytest.mark.parametrize("cols", [1, 3, 64, 100, 1024, 2048, 4096, 5000, 8192, 16384, 65536])
@pytest.mark.parametrize("rows", [1, 100, 16384])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_norm_tiles_match_the_old_formulas(cols, rows, dtype):
    bn = next_power_of_2(cols)
    fwd = plan_norm_fwd(rows, cols, x_dtype=dtype, residual_dtype=None, is_rms=True, has_weight=True,
                        has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6, target=H200,
                        config=NormConfig()).launches[0]
    m = max(1, min(16, 8192 // bn))
    assert (fwd.constexpr_dict()["BLOCK_M"], fwd.num_warps) == (m, max(4, min(16, m * bn // 1024)))
    bwd = plan_norm_bwd(rows, cols, dx_dtype=dtype, weight_dtype=dtype, bias_dtype=None, is_rms=True,
                        has_dh=False, dropout_p=0.0, target=H200, config=NormConfig()).launches[0]
    m = max(1, min(4, 16384 // bn))
    assert (bwd.constexpr_dict()["BLOCK_M"], bwd.num_warps) == (m, max(4, min(16, m * bn // 1024)))


def _old_ce(rows, vocab, config: CEConfig):
    block_v = min(config.block_v, next_power_of_2(vocab)) if config.block_v else min(next_power_of_2(vocab), 2048)
    if config.block_n is not None:
        block_n = config.block_n
    else:
        block_n = max(1, min(16, 4096 // block_v))
        if config.block_v is None and cdiv(rows, block_n) < 2 * 132:
            block_n, block_v = 1, min(next_power_of_2(vocab), 4096)
    return block_n, block_v, config.num_warps or (8 if block_n * block_v >= 4096 else 4)


@pytest.mark.parametrize("vocab", [2, 100, 1000, 2048, 32000, 50257, 128256, 262144])
@pytest.mark.parametrize("rows", [1, 256, 528, 8192])
@pytest.mark.parametrize("config", [CEConfig(), CEConfig(block_v=1024), CEConfig(block_n=4), CEConfig(num_warps=16)])
def test_cross_entropy_tiles_match_the_old_formula(vocab, rows, config):
    launch = plan_ce_fwd(rows, vocab, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0,
                         target=H200, config=config).launches[0]
    c = launch.constexpr_dict()
    assert (c["BLOCK_N"], c["BLOCK_V"], launch.num_warps) == _old_ce(rows, vocab, config)
