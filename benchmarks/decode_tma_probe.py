"""Would TMA loads move the B=1 S=16k decode step? A torch-only probe beside the library's kernel (H200).

The library's split kernel streams K and V through cp.async into a 3-stage shared-memory pipeline and takes
21.3 us at B=1 S=16k (Hq=32, Hkv=8, D=128, 16 splits, one program per SM) against 17.2 us for a bare read of
the same 67 MB; the bar (3.4 TB/s) leaves 19.7 us for the whole step. Hopper's tensor memory accelerator
(TMA) copies a whole tile per instruction into shared memory and signals an mbarrier, which the fastest
Hopper decode kernels use to keep more bytes in flight per SM. The library cannot use it in the JAX path
(jaxlib's Triton launcher passes a null global scratch pointer, which device-side descriptors need, and
jax-triton 0.3.1 has no host-side descriptor arguments), so this probe measures what it would buy before
anyone builds around that: the same split-KV step (one query token, GQA rows packed, full key blocks, exact
online softmax, the library's merge kernel for the partial states) written twice in one small kernel, K / V
through pointers (cp.async, the control) or through device-side tensor descriptors (TMA), at several
depths, warp counts and with Triton's warp specialisation, against the library's default plan, every row a
CUDA graph over caches rotated past L2 (as ``bench_decode.py``).

    python benchmarks/decode_tma_probe.py            # writes decode_tma_probe_h200.json to $OUT or .

Not part of the library: a measurement only (contiguous NHD bf16 cache, B=1, Sq=1, lengths a multiple of
splits x block).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode import D, HKV, HQ, _graph_time, kv_bytes, make_caches, n_copies  # noqa: E402

GROUP = HQ // HKV


@triton.jit
def probe_split_kernel(Q, K, V, PART_O, PART_L, SEQLENS, keys_per_split, total_keys, sm_scale, stride_rt,
                       HEADS_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr, WARP_SPEC: tl.constexpr,
                       LOAD_LEN: tl.constexpr = False, RUNTIME_STRIDE: tl.constexpr = False):
    """Grid (splits, Hkv). Partial (out, lse) of split ``s`` for query head ``h`` at ``PART_O[s, h, :]`` /
    ``PART_L[s, h]`` (natural-log lse), the layout the library's merge kernel reads. Two of the library
    kernel's properties can be switched on to see what each costs: LOAD_LEN takes the split's key range from
    the sequence length in ``SEQLENS`` (a load the first K / V requests then wait for, as the library's
    ragged lengths need), RUNTIME_STRIDE the token stride from ``stride_rt`` instead of a constant (the
    library's strides are runtime integers: 64-bit multiplies per address instead of shifts)."""
    split = tl.program_id(0)
    kh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    h = kh * GROUP + rows
    offs_d = tl.arange(0, D)
    q = tl.load(Q + h[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if LOAD_LEN:
        keys_per_split = tl.load(SEQLENS) // tl.num_programs(0)
    lo = split * keys_per_split
    if RUNTIME_STRIDE:
        stride_s = stride_rt
    else:
        stride_s = HEADS_KV * D
    if TMA:
        k_desc = tl.make_tensor_descriptor(K + kh * D, shape=[total_keys, D], strides=[stride_s, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V + kh * D, shape=[total_keys, D], strides=[stride_s, 1],
                                           block_shape=[BLOCK_N, D])
    for start in tl.range(lo, lo + keys_per_split, BLOCK_N, num_stages=STAGES, warp_specialize=WARP_SPEC):
        if TMA:
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            offs_n = start + tl.arange(0, BLOCK_N)
            rows_kv = tl.cast(offs_n, tl.int64)[:, None] * stride_s + kh * D + offs_d[None, :]
            k = tl.load(K + rows_kv)
            v = tl.load(V + rows_kv)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453
    n_heads = HEADS_KV * GROUP
    tl.store(PART_O + (split * n_heads + h)[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None])
    tl.store(PART_L + split * n_heads + h, lse, mask=row_ok)


# (block_n, warps, stages, TMA, warp specialisation[, length loaded, runtime stride]); splits at one program per
# SM like the library's plan. H200, 2026-11-30: TMA slower than cp.async at every setting,
# and the pointer control itself 2.7 us faster than the library's kernel; the last three rows ask why.
VARIANTS = [(128, 4, 3, False, False), (128, 4, 3, True, False), (128, 4, 2, True, False), (128, 4, 4, True, False),
            (128, 8, 3, True, False), (64, 4, 4, True, False), (64, 4, 6, True, False), (128, 4, 3, True, True),
            (64, 4, 4, True, True), (128, 8, 3, True, True), (128, 4, 3, False, False, True, False),
            (128, 4, 3, False, False, False, True), (128, 4, 3, False, False, True, True)]
ATTRIBUTION = [v for v in VARIANTS if not v[3]]  # --attribution: the pointer variants only


def main():
    import torch

    from flashbridge.core_kernels.decode.plan import plan_merge
    from flashbridge.torch_api._runtime import execute, target_for
    from flashbridge.torch_api.decode import decode_attention

    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--splits", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the whole list")
    parser.add_argument("--attribution", action="store_true", help="only the pointer variants")
    args = parser.parse_args()
    variants = ATTRIBUTION if args.attribution else VARIANTS

    # device-side tensor descriptors live in a global scratch buffer the launcher allocates through this hook
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    b, s, splits = 1, args.seqlen, args.splits
    nbytes = kv_bytes(b, s, 2)
    caches = make_caches(b, s, copies=n_copies(nbytes))
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    scale = D ** -0.5
    part_o = torch.empty(splits, HQ, D, device="cuda", dtype=torch.float32)
    part_l = torch.empty(splits, HQ, device="cuda", dtype=torch.float32)
    merge = plan_merge(splits, HQ, D, "bfloat16", target=target_for(q.device))

    def probe_step(variant, k, v, with_merge=True):
        block_n, warps, stages, tma, ws, load_len, runtime_stride = (*variant, False, False)[:7]
        probe_split_kernel[(splits, HKV)](q, k, v, part_o, part_l, lens, s // splits, s, scale, HKV * D,
                                          HEADS_KV=HKV, GROUP=GROUP, D=D, BLOCK_M=16, BLOCK_N=block_n, TMA=tma,
                                          STAGES=stages, WARP_SPEC=ws, LOAD_LEN=load_len,
                                          RUNTIME_STRIDE=runtime_stride, num_warps=warps)
        if with_merge:
            return execute(merge, {"outs": part_o, "lses": part_l})
        return None

    k0, v0, _ = caches[0]
    ref, ref_lse = decode_attention(q, k0, v0, cache_seqlens=lens, num_splits=splits, return_lse=True)
    rows = []
    checked = {}
    for variant in variants:  # correctness first: the merged probe against the library's decode
        try:
            part_o.fill_(float("nan"))
            out, lse = probe_step(variant, k0, v0)
            err = (out.float().reshape(ref.shape) - ref.float()).abs().max().item()
            lse_err = (lse.reshape(1, 1, HQ).transpose(1, 2) - ref_lse).abs().max().item()
            checked[variant] = err < 2e-2 and lse_err < 1e-3
            print("check", variant, f"max |out - library| {err:.2e}, |lse - library| {lse_err:.2e}", flush=True)
        except Exception as exc:  # e.g. a variant this Triton cannot compile
            checked[variant] = False
            print("check", variant, "error", f"{type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for rnd in range(args.rounds):
        it = itertools.cycle(caches)

        def library_step():
            k, v, _ = next(it)
            return decode_attention(q, k, v, cache_seqlens=lens, num_splits=splits)

        library_step()
        ms = _graph_time(library_step)
        rows.append({"round": rnd, "provider": "library default", "ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12})
        print(rows[-1], flush=True)
        for variant in variants:
            if not checked[variant]:
                continue
            for with_merge in (False, True):
                def step():
                    k, v, _ = next(it)
                    return probe_step(variant, k, v, with_merge)

                step()
                ms = _graph_time(step)
                rows.append({"round": rnd, "provider": "probe", "variant": dict(zip(
                    ("block_n", "warps", "stages", "tma", "warp_specialize", "length_loaded", "runtime_stride"),
                    variant)), "merge": with_merge,
                    "ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12})
                print(rows[-1], flush=True)
    out_dir = os.environ.get("OUT") or "."
    path = os.path.join(out_dir, "decode_tma_probe_attribution_h200.json" if args.attribution
                        else "decode_tma_probe_h200.json")
    with open(path, "w") as f:
        json.dump({"shape": {"b": b, "s": s, "hq": HQ, "hkv": HKV, "d": D, "splits": splits},
                   "checked": {str(k): v for k, v in checked.items()}, "rows": rows,
                   "versions": {"torch": torch.__version__, "triton": triton.__version__}}, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
