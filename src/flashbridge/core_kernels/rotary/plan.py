"""Launch plans for rotary position embeddings (pure Python: shapes and options in, a Plan out).

``x`` (and the optional ``k``) are ``(B, S, H, D)`` or packed ``(T, H, D)``; both are seen as a list of
tokens (``B * S`` or ``T``) with strides per (batch, sequence, head) and a contiguous head dim. Outputs are
contiguous, or, in place, the inputs' own buffers (same strides). ``cos`` / ``sin`` are contiguous
``(S_rot, rotary_dim / 2)`` tables.
"""
from __future__ import annotations

import dataclasses
import functools

from .._plan import (DTYPE_BYTES, FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, fmt_shape,
                     next_power_of_2, pow2_divisor)

_KERNEL = "rotary.kernels:rotary_kernel"
POS_MODES = {"sequence": 0, "position_ids": 1, "cu_seqlens": 2}
INDEX_DTYPES = ("int32", "int64")


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    """Block sizes. ``None`` picks the default for the target.

    block_t: tokens per program (a power of two). Default: enough that every thread moves 16-byte vectors
        (see _tile), more while a program holds at most ``elements`` elements (q and k heads together,
        whole head dims).
    num_warps: warps per program (default 4).
    elements: the per-program element budget that sets the default block_t (and splits the heads of a
        token between programs when one token alone is larger); the default block_t may exceed it to keep
        16-byte accesses.
    """

    block_t: int | None = None
    num_warps: int | None = None
    elements: int = 8192


@dataclasses.dataclass(frozen=True)
class RotaryShape:
    """What a rotary call looks like, once validated (hashable: plans are cached on it)."""

    x_shape: tuple[int, ...]
    k_shape: tuple[int, ...] | None
    n_tokens: int  # B * S, or T when packed
    seqlen: int  # S, or T when packed (then every token is in "batch" 0)
    heads: int
    k_heads: int  # 0 without k
    head_dim: int
    half: int  # rotary_dim / 2 = cos.shape[1]
    rot_rows: int  # cos.shape[0]
    pos_mode: str  # one of POS_MODES
    pos_batch: int  # rows of position_ids (1 broadcasts over the batch); 1 otherwise
    n_seqs: int  # sequences in cu_seqlens; 1 otherwise


def _check_index(name: str, arg, expected: tuple[int, ...] | list[tuple[int, ...]]) -> None:
    shape, dtype = arg
    if dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: dtype {dtype} is not supported; use int32 or int64")
    allowed = expected if isinstance(expected, list) else [expected]
    if tuple(shape) not in allowed:
        raise ValueError(f"{name}: expected shape {' or '.join(map(fmt_shape, allowed))}, got {fmt_shape(shape)}")


def check_rotary_args(*, x, cos, sin, k=None, position_ids=None, cu_seqlens=None, x_name="x") -> RotaryShape:
    """Validate a rotary call from (shape, dtype-name) pairs (None for absent arguments); ``x_name`` is
    what the caller calls x (q for the q-and-k form). Shared by both front-ends so that both raise the
    same errors, before any launch."""
    shape, dtype = x
    check_float_dtype(x_name, dtype)
    packed = len(shape) == 3
    if len(shape) not in (3, 4):
        raise ValueError(f"{x_name}: expected (batch, seqlen, heads, head_dim) or packed (total_tokens, heads, "
                         f"head_dim), got shape {fmt_shape(shape)}")
    if any(d < 1 for d in shape):
        raise ValueError(f"{x_name}: empty tensor of shape {fmt_shape(shape)}")
    lead, heads, head_dim = tuple(shape[:-2]), shape[-2], shape[-1]
    if k is not None:
        check_float_dtype("k", k[1])
        if k[1] != dtype:
            raise TypeError(f"k: dtype {k[1]} must match {x_name} ({dtype})")
        k_shape = tuple(k[0])
        if len(k_shape) != len(shape) or k_shape[:-2] != lead or k_shape[-1] != head_dim or k_shape[-2] < 1:
            raise ValueError(f"k: expected shape {fmt_shape((*lead, 'heads', head_dim))} ({x_name}'s tokens and head "
                             f"dim), got {fmt_shape(k_shape)}")
    for name, arg in (("cos", cos), ("sin", sin)):
        check_float_dtype(name, arg[1])
        if len(arg[0]) != 2 or arg[0][0] < 1 or arg[0][1] < 1:
            raise ValueError(f"{name}: expected shape (seqlen_rotary, rotary_dim / 2), got {fmt_shape(arg[0])}")
    if tuple(sin[0]) != tuple(cos[0]) or sin[1] != cos[1]:
        raise ValueError(f"sin: expected the shape and dtype of cos {cos[1]}{fmt_shape(cos[0])}, got "
                         f"{sin[1]}{fmt_shape(sin[0])}")
    rot_rows, half = cos[0]
    if 2 * half > head_dim:
        raise ValueError(f"cos: rotary_dim = 2 * cos.shape[1] = {2 * half} exceeds the head dim of {x_name} "
                         f"({head_dim})")
    if position_ids is not None and cu_seqlens is not None:
        raise ValueError("position_ids: pass either position_ids or cu_seqlens, not both")
    n_seqs, pos_batch = 1, 1
    if cu_seqlens is not None:
        if not packed:
            raise ValueError(f"cu_seqlens: needs a packed {x_name} of shape (total_tokens, heads, head_dim), got "
                             f"{fmt_shape(shape)}")
        if len(cu_seqlens[0]) != 1 or cu_seqlens[0][0] < 2:
            raise ValueError(f"cu_seqlens: expected shape (num_seqs + 1,) with at least one sequence, got "
                             f"{fmt_shape(cu_seqlens[0])}")
        _check_index("cu_seqlens", cu_seqlens, tuple(cu_seqlens[0]))
        n_seqs, mode = cu_seqlens[0][0] - 1, "cu_seqlens"
    elif position_ids is not None:
        if packed:
            _check_index("position_ids", position_ids, lead)
        else:
            _check_index("position_ids", position_ids, [lead, (1, lead[1])])
            pos_batch = position_ids[0][0]
        mode = "position_ids"
    elif packed:
        raise ValueError(f"cu_seqlens: a packed {x_name} (total_tokens, heads, head_dim) needs cu_seqlens or "
                         "position_ids")
    else:
        mode = "sequence"
        if lead[1] > rot_rows:
            raise ValueError(f"cos: {rot_rows} rows (positions) but {x_name} has seqlen {lead[1]}; pass a table of at "
                             f"least {lead[1]} rows, or position_ids")
    n_tokens = lead[0] * (1 if packed else lead[1])
    return RotaryShape(
        x_shape=tuple(shape), k_shape=None if k is None else tuple(k[0]), n_tokens=n_tokens,
        seqlen=n_tokens if packed else lead[1], heads=heads, k_heads=0 if k is None else k[0][-2],
        head_dim=head_dim, half=half, rot_rows=rot_rows, pos_mode=mode, pos_batch=pos_batch, n_seqs=n_seqs)


def check_rotary_values(shape: RotaryShape, *, position_ids=None, cu_seqlens=None) -> None:
    """Checks of the index arrays' values (flat Python lists), where the front-end can read them for free
    (host arrays): the kernel clamps positions to the table instead, it cannot raise."""
    if position_ids is not None:
        bad = [p for p in position_ids if not 0 <= p < shape.rot_rows]
        if bad:
            raise ValueError(f"position_ids: {len(bad)} value(s) outside the table's rows [0, {shape.rot_rows}), "
                             f"e.g. {bad[0]}")
    if cu_seqlens is not None:
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != shape.n_tokens:
            raise ValueError(f"cu_seqlens: must start at 0 and end at the number of tokens {shape.n_tokens}, got "
                             f"{cu_seqlens[0]} .. {cu_seqlens[-1]}")
        lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        if min(lengths) < 0:
            raise ValueError("cu_seqlens: must be non-decreasing")
        if max(lengths) > shape.rot_rows:
            raise ValueError(f"cu_seqlens: a sequence of {max(lengths)} tokens is longer than the table's "
                             f"{shape.rot_rows} rows")


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, sequence, head) element strides of a contiguous x; packed x has one "batch" (stride 0)."""
    heads, head_dim = shape[-2:]
    row = heads * head_dim
    return (shape[1] * row, row, head_dim) if len(shape) == 4 else (0, row, head_dim)


def _tile(shape: RotaryShape, itemsize: int, target: Target, config: RotaryConfig) -> tuple[int, int, int, int, int]:
    """(block_t, block_h, block_hk, head blocks, warps). One token's heads are split between programs only
    when they alone exceed the element budget; q and k heads are then split into the same number of
    blocks. Tokens per program: at least enough that the smallest tile (k's heads, a half head dim) gives
    every thread a 16-byte vector (fewer elements per thread than that and the accesses narrow to 4 or 8
    bytes: sm_90 PTX of the Llama q + k tile with one token per program), then more while within budget."""
    budget = 1 << 16 if target.interpret else config.elements
    rot_block = next_power_of_2(shape.half)
    pass_dims = shape.head_dim - 2 * shape.half
    pass_block = next_power_of_2(pass_dims) if pass_dims else 0
    dim = 2 * rot_block + pass_block
    blocks = max(1, cdiv((shape.heads + shape.k_heads) * dim, budget))
    block_h = next_power_of_2(cdiv(shape.heads, blocks))
    blocks = cdiv(shape.heads, block_h)
    block_hk = next_power_of_2(cdiv(shape.k_heads, blocks)) if shape.k_heads else 0
    if shape.k_heads:
        blocks = max(blocks, cdiv(shape.k_heads, block_hk))
    num_warps = config.num_warps or 4
    per_token = (block_h + block_hk) * dim
    smallest = min(block_hk or block_h, block_h) * min(rot_block, pass_block or rot_block)
    block_t = config.block_t
    if block_t is None:
        cap = min(next_power_of_2(shape.n_tokens), 64)
        block_t = 1
        while block_t < cap and (block_t * smallest < (16 // itemsize) * 32 * num_warps
                                 or 2 * block_t * per_token <= budget):
            block_t *= 2
    return block_t, block_h, max(block_hk, 1), blocks, num_warps


@functools.lru_cache(maxsize=1024)
def plan_rotary(
    shape: RotaryShape, *, dtype: str, interleaved: bool, conjugate: bool, inplace: bool, target: Target,
    strides: tuple[tuple[int, int, int], tuple[int, int, int] | None] | None = None,
    config: RotaryConfig = RotaryConfig(),
) -> Plan:
    """Plan inputs: x, [k], cos, sin, [position_ids], [cu_seqlens] (contiguous index arrays).

    ``strides``: x's and k's (batch, sequence, head) element strides, head dim contiguous; default
    contiguous. Results: out (x's shape), and out_k (k's shape) with k, in ``dtype``. ``inplace``: the
    results must be written through the inputs' own buffers (the torch runtime's ``out=``, the JAX runtime's
    ``aliases``); the kernel then leaves the pass-through dims alone.
    """
    assert dtype in FLOAT_DTYPES and shape.pos_mode in POS_MODES
    has_k = shape.k_shape is not None
    x_strides, k_strides = strides or (contiguous_strides(shape.x_shape),
                                       contiguous_strides(shape.k_shape) if has_k else None)
    k_strides = k_strides if has_k else (0, 0, 0)
    present = {"x": True, "k": has_k, "cos": True, "sin": True,
               "position_ids": shape.pos_mode == "position_ids", "cu_seqlens": shape.pos_mode == "cu_seqlens"}
    block_t, block_h, block_hk, head_blocks, num_warps = _tile(shape, DTYPE_BYTES[dtype], target, config)
    pass_dims = shape.head_dim - 2 * shape.half
    if shape.pos_mode == "position_ids":
        pos_strides = (0, 1) if len(shape.x_shape) == 3 or shape.pos_batch == 1 else (shape.seqlen, 1)
    else:
        pos_strides = (0, 0)
    buffers = (Spec("out", shape.x_shape, dtype), Spec("out_k", shape.k_shape if has_k else (0,), dtype))
    launch = Launch(
        kernel=_KERNEL,
        grid=(cdiv(shape.n_tokens, block_t), head_blocks),
        # absent inputs are stood in for by cos: never by x, whose buffer the output may take over (JAX)
        inputs=tuple(name if here else "cos" for name, here in present.items()),
        scalars=(("n_tokens", shape.n_tokens), ("seqlen", shape.seqlen), ("n_seqs", shape.n_seqs),
                 ("search_steps", (shape.n_seqs - 1).bit_length()), ("rot_rows", shape.rot_rows),
                 *zip(("stride_xb", "stride_xs", "stride_xh"), x_strides),
                 *zip(("stride_kb", "stride_ks", "stride_kh"), k_strides),
                 ("stride_pb", pos_strides[0]), ("stride_ps", pos_strides[1])),
        outputs=("out", "out_k"),
        constexprs=(("HEADS", shape.heads), ("K_HEADS", shape.k_heads), ("HALF", shape.half), ("PASS", pass_dims),
                    ("BLOCK_T", block_t), ("BLOCK_H", block_h), ("BLOCK_HK", block_hk),
                    ("ROT_BLOCK", next_power_of_2(shape.half)), ("BLOCK_PASS", next_power_of_2(max(pass_dims, 1))),
                    ("INTERLEAVED", bool(interleaved)), ("CONJUGATE", bool(conjugate)), ("INPLACE", bool(inplace)),
                    ("HAS_K", has_k), ("POS_MODE", POS_MODES[shape.pos_mode]),
                    ("COPY_PASS", pass_dims > 0 and not inplace),
                    ("STRIDE_ALIGN", pow2_divisor(*x_strides, *k_strides))),
        num_warps=num_warps,
        num_stages=1,
    )
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=buffers, launches=(launch,),
                results=("out", "out_k") if has_k else ("out",))
