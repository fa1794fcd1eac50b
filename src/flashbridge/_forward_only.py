"""The forward-only ops (inference: decode, caches, merges) and the error both front-ends raise when a
gradient reaches one: by its backward in torch, while ``jax.grad`` traces in JAX. Without it torch returned
outputs with ``requires_grad=False`` (the gradient silently lost) and JAX failed inside its callback
machinery with a message that named neither the op nor a way out."""
from __future__ import annotations

FORWARD_ONLY_OPS = ("decode_attention", "cascade_attention", "merge_attention_states", "append_kv_cache",
                    "mla_decode", "flash_attention with block_table / seqused_k")


def no_backward_message(name: str) -> str:
    """The error of differentiating the forward-only op ``name`` (the same words in both front-ends)."""
    return (f"{name} has no backward: it is a forward-only (inference) op and gradients cannot flow through "
            "it. Differentiate attention with flash_attention (or mla_attention), which have one; or keep the "
            "gradient away from this op (torch: torch.no_grad() / .detach(); JAX: jax.lax.stop_gradient)")
