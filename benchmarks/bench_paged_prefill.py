"""Chunked prefill over a paged KV cache: flash_attention(..., block_table=, seqused_k=) beside the same
prefill on a contiguous cache (packed keys, cu_seqlens_k), same keys, same run, bf16, causal.

Each of B sequences has ``--cached`` keys already in the cache plus a new chunk of ``--chunk`` queries whose
keys are in the cache too (seqused_k = cached + chunk): the step vLLM / SGLang run for chunked prefill.
Pages are a shuffled draw from the pool, so consecutive pages of a sequence are not adjacent in memory.
TFLOP/s = 4 * Hq * D * (visible query-key pairs). The bar: paged within 10% of contiguous.

    python benchmarks/bench_paged_prefill.py                      # page sizes 16, 64, 256; D = 128
    python benchmarks/bench_paged_prefill.py --page-sizes 16 --dims 64,128 --jax
"""
from __future__ import annotations

import argparse

from _common import print_table, save, time_jax, time_torch

import torch

from flashbridge.torch_api.attention import flash_attention

HQ, HKV = 32, 8


def _case(batch, cached, chunk, d, page_size, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    used = cached + chunk
    pages_per = -(-used // page_size)
    num_pages = batch * pages_per + 16
    k_cache = torch.randn(num_pages, page_size, HKV, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(num_pages, page_size, HKV, d, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(num_pages, device="cuda", generator=g)[:batch * pages_per]
    table = perm.reshape(batch, pages_per).to(torch.int32)
    slots = torch.arange(used, device="cuda")
    k = k_cache[table[:, slots // page_size].long(), slots % page_size].reshape(batch * used, HKV, d)
    v = v_cache[table[:, slots // page_size].long(), slots % page_size].reshape(batch * used, HKV, d)
    q = torch.randn(batch * chunk, HQ, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = torch.arange(0, (batch + 1) * chunk, chunk, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, (batch + 1) * used, used, device="cuda", dtype=torch.int32)
    seqused = torch.full((batch,), used, device="cuda", dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, table=table, seqused=seqused, cu_q=cu_q, k=k, v=v,
                cu_k=cu_k, used=used)


def _jax_timings(c, chunk, used) -> dict:
    import jax.numpy as jnp

    from flashbridge.jax_api.attention import flash_attention as jfa

    def to_jax(t):
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.float().cpu().numpy()).astype(jnp.bfloat16)
        return jnp.asarray(t.cpu().numpy())

    j = {n: to_jax(t) for n, t in c.items() if isinstance(t, torch.Tensor)}

    def paged(q, k_cache, v_cache, table, seqused, cu_q):
        return jfa(q, k_cache, v_cache, causal=True, block_table=table, seqused_k=seqused, cu_seqlens_q=cu_q,
                   max_seqlen_q=chunk)

    def contiguous(q, k, v, cu_q, cu_k):
        return jfa(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=chunk, max_seqlen_k=used)

    return {"jax paged": time_jax(paged, j["q"], j["k_cache"], j["v_cache"], j["table"], j["seqused"], j["cu_q"]),
            "jax contiguous": time_jax(contiguous, j["q"], j["k"], j["v"], j["cu_q"], j["cu_k"])}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cached", type=int, default=3584)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dims", default="128")
    ap.add_argument("--page-sizes", default="16,64,256")
    ap.add_argument("--jax", action="store_true", help="also time the JAX front-end (paged and contiguous)")
    args = ap.parse_args()
    rows, records = [], []
    for d in map(int, args.dims.split(",")):
        for page_size in map(int, args.page_sizes.split(",")):
            c = _case(args.batch, args.cached, args.chunk, d, page_size)
            chunk, used = args.chunk, c["used"]
            paged = lambda: flash_attention(c["q"], c["k_cache"], c["v_cache"], causal=True,  # noqa: E731
                                            block_table=c["table"], seqused_k=c["seqused"],
                                            cu_seqlens_q=c["cu_q"], max_seqlen_q=chunk)
            contiguous = lambda: flash_attention(c["q"], c["k"], c["v"], causal=True,  # noqa: E731
                                                 cu_seqlens_q=c["cu_q"], cu_seqlens_k=c["cu_k"],
                                                 max_seqlen_q=chunk, max_seqlen_k=used)
            torch.testing.assert_close(paged(), contiguous(), rtol=0, atol=0)  # the same keys: the same bits
            pairs = args.batch * (chunk * (used - chunk) + chunk * (chunk + 1) // 2)
            flops = 4 * HQ * d * pairs
            timings = {"torch paged": time_torch(paged), "torch contiguous": time_torch(contiguous)}
            if args.jax:
                timings.update(_jax_timings(c, chunk, used))
            for name, ms in timings.items():
                rows.append([d, page_size, name, f"{ms:.3f}", f"{flops / ms / 1e9:.1f}"])
            ratio = timings["torch paged"] / timings["torch contiguous"]
            rows.append([d, page_size, "paged / contiguous", f"{ratio:.3f}", "ok" if ratio <= 1.10 else "OVER 10%"])
            records.append({"head_dim": d, "page_size": page_size, "batch": args.batch, "cached": args.cached,
                            "chunk": chunk, "hq": HQ, "hkv": HKV, "ms": timings, "tflops": {
                                n: flops / ms / 1e9 for n, ms in timings.items()}, "paged_over_contiguous": ratio})
    print_table(f"chunked prefill, B={args.batch}, {args.cached} cached + {args.chunk} new tokens, Hq={HQ}, "
                f"Hkv={HKV}, bf16, causal", ["D", "page", "row", "ms", "TFLOP/s"], rows)
    print(f"wrote {save('bench_paged_prefill', {'rows': records})}")


if __name__ == "__main__":
    main()
