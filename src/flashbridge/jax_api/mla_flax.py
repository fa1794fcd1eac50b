"""Flax NNX DeepSeek-V3 multi-head latent attention over flashbridge's kernels (the torch module's twin)."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import flash_attention
from .flax import RMSNorm
from .mla import mla_decode


def rotary(x, positions, theta: float):
    """Rotary position embedding (rotate-half form) of ``x`` ``(B, S, ..., D)`` at ``positions`` ``(B, S)``,
    in float32: the pairs ``(x[i], x[i + D/2])`` turn by ``position * theta^(-2i/D)``."""
    d = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    angles = angles.reshape(*angles.shape[:2], *([1] * (x.ndim - 3)), d // 2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class MultiHeadLatentAttention(nnx.Module):
    """DeepSeek-V3 multi-head latent attention (Flax NNX), the same configuration, parameter names and two
    paths as :class:`flashbridge.torch_api.MultiHeadLatentAttention` (``nnx.Linear`` kernels are the
    transposes of torch's weights):

    * ``__call__(hidden_states, positions=None)``: training / prefill, un-absorbed (per-head keys and
      values from the latent, causal :func:`flash_attention` with Dqk = nope + rope, Dv = v_head_dim);
    * ``decode(hidden_states, kv_cache, cache_seqlens, ...)``: absorbed over a latent cache
      (:func:`mla_decode`); returns ``(out, kv_cache)`` with the new tokens' rows written at
      ``cache_seqlens[b] + i`` (functionally: donate the cache under jit to update it in place).

    Example::

        >>> mla = MultiHeadLatentAttention(64, 4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        ...                                qk_rope_head_dim=8, v_head_dim=16, rngs=nnx.Rngs(0))
        >>> x = jnp.ones((2, 10, 64))
        >>> y = mla(x)
        >>> y_step, cache = mla.decode(x[:, :1], jnp.zeros((2, 16, 40)), jnp.zeros((2,), jnp.int32))
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, *, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-6, attention_bias: bool = False, softmax_scale: Optional[float] = None,
                 dtype: Optional[Any] = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even (RoPE turns pairs of dims), got {qk_rope_head_dim}")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_theta = rope_theta
        self.softmax_scale = self.qk_head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)

        def linear(n_in, n_out, bias):
            return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, num_heads * self.qk_head_dim, False)
        else:
            self.q_a_proj = linear(hidden_size, q_lora_rank, attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, epsilon=rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                                         rngs=rngs)
            self.q_b_proj = linear(q_lora_rank, num_heads * self.qk_head_dim, False)
        self.kv_a_proj_with_mqa = linear(hidden_size, kv_lora_rank + qk_rope_head_dim, attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, epsilon=rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), False)
        self.o_proj = linear(num_heads * v_head_dim, hidden_size, attention_bias)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _query(self, x, positions):
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:2], self.num_heads, self.qk_head_dim)
        return q[..., :self.qk_nope_head_dim], rotary(q[..., self.qk_nope_head_dim:], positions, self.rope_theta)

    def latent(self, x, positions):
        """The cache rows ``[c_kv, k_rope]`` ``(B, S, kv_lora_rank + qk_rope_head_dim)`` of tokens ``x``."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[..., :self.kv_lora_rank])
        return jnp.concatenate([c_kv, rotary(kv[..., self.kv_lora_rank:], positions, self.rope_theta)], -1)

    def _up_projections(self):
        w = self.kv_b_proj.kernel[...].T.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                                 self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def __call__(self, hidden_states: jax.Array, positions: Optional[jax.Array] = None) -> jax.Array:
        b, s, _ = hidden_states.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q_nope, q_rope = self._query(hidden_states, positions)
        latent = self.latent(hidden_states, positions)
        kv = self.kv_b_proj(latent[..., :self.kv_lora_rank]).reshape(b, s, self.num_heads, -1)
        k_rope = jnp.broadcast_to(latent[:, :, None, self.kv_lora_rank:], (b, s, self.num_heads, self.qk_rope_head_dim))
        k = jnp.concatenate([kv[..., :self.qk_nope_head_dim], k_rope.astype(kv.dtype)], -1)
        q = jnp.concatenate([q_nope, q_rope], -1)
        out = flash_attention(q, k, kv[..., self.qk_nope_head_dim:], causal=True, softmax_scale=self.softmax_scale)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.v_head_dim))

    def decode(self, hidden_states, kv_cache, cache_seqlens, *, block_table=None, positions=None,
               num_splits: Optional[int] = None):
        """Outputs of the new tokens ``hidden_states`` ``(B, Sq, hidden)`` of sequences whose caches hold
        ``cache_seqlens`` tokens (before this call), and the cache with their latent rows written; the
        caller advances ``cache_seqlens`` by Sq."""
        b, sq, _ = hidden_states.shape
        rows = cache_seqlens[:, None] + jnp.arange(sq, dtype=cache_seqlens.dtype)
        if positions is None:
            positions = rows
        q_nope, q_rope = self._query(hidden_states, positions)
        latent = jax.lax.stop_gradient(self.latent(hidden_states, positions)).astype(kv_cache.dtype)
        if block_table is None:
            kv_cache = kv_cache.at[jnp.arange(b)[:, None], rows].set(latent)
        else:
            page_size = kv_cache.shape[1]
            pages = jnp.take_along_axis(block_table, rows // page_size, axis=1)
            kv_cache = kv_cache.at[pages, rows % page_size].set(latent)
        w_uk, w_uv = self._up_projections()
        q = jnp.concatenate([jnp.einsum("bshn,hnr->bshr", q_nope, w_uk.astype(q_nope.dtype)), q_rope], -1)
        out = mla_decode(q, kv_cache, cache_seqlens=cache_seqlens + sq, block_table=block_table,
                         head_dim_v=self.kv_lora_rank, softmax_scale=self.softmax_scale, num_splits=num_splits)
        out = jnp.einsum("bshr,hvr->bshv", out, w_uv.astype(out.dtype))
        return self.o_proj(out.reshape(b, sq, self.num_heads * self.v_head_dim)), kv_cache
