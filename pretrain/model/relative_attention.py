"""T5's self-attention with its trainable relative position bias, fused in Triton kernels (`attention: triton`).

    out = relative_attention(qkv, bias_by_offset, num_heads, causal=False)   # qkv [B, L, 3*H*D] -> out [B, L, H*D]

Scores are s[b, h, i, j] = q_i . k_j + bias_by_offset[h, j - i + L - 1] (+ key_bias[b, j]), unscaled as in T5; the
decoder's are causal (j <= i). The position bias of T5 depends on the offset j - i only, through its buckets, so the
kernels read it from a [H, 2L - 1] vector per head (`Stack.offset_bias`: the bucket table looked up per offset) and
never hold an [H, L, L] bias; FlexAttention reads a dense [H, L, L] fp32 bias for every batch row and, in backward,
adds each score's gradient into it atomically (docs/model.md). Here the backward sums the gradient of each score
tile along its diagonals (one offset each) inside the kernel; a program's tiles fill one row of sums (one per offset
it sees), and the sum over batch rows and key blocks is two plain reductions afterwards. No atomics: the gradients
are the same bit for bit from run to run. Tiles whose offsets all lie where T5's buckets have stopped changing
(`saturate`: the encoder's 91 on) are summed whole instead of by diagonals, their sum put at the range's first
offset, and both backward passes add such a tile's one bias value instead of loading it per score. Where the
length is a whole number of blocks (the encoder's 512) the kernels load, store and score without masks.

The kernels take the fused q|k|v projection as it comes out of its matmul ([B, L, 3, H, D] in memory) and write
the output as [B, L, H, D] and the gradient of q|k|v as one [B, L, 3, H, D] tensor: no permute or copy around them.
Three kernels, FlashAttention-2's scheme: forward (online softmax, the log-sum-exp kept for backward); backward in
two passes that recompute the probabilities, one per key block (dk, dv and the bias gradient), one per query block
(dq). Both directions are `torch.library` custom ops, so `torch.compile` keeps them whole inside the compiled
blocks.

Triton is imported with this module (the model imports it only for `attention: triton`). On a machine without a
GPU the kernels run in Triton's interpreter when TRITON_INTERPRET=1 is set before this module is imported (the
tests do; slow, for correctness only).
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)   # a constexpr: kernels read no other globals

# Block shapes and launch settings of the three kernels (measured on one H200: docs/model.md). BLOCK of the key-block
# pass is square: its bias-gradient diagonals need it. SETTINGS_VARIABLE, a JSON object such as {"FORWARD":
# {"BLOCK_N": 128}} (what `scripts/bench_attention_gpu.py --sweep` prints for another GPU), overrides them.
FORWARD = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
BACKWARD_KV = {"BLOCK": 64, "num_warps": 4, "num_stages": 3}
BACKWARD_Q = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
SETTINGS_VARIABLE = "T5ZERO_ATTENTION_SETTINGS"


def _apply_settings(raw: str) -> None:
    """Update FORWARD / BACKWARD_KV / BACKWARD_Q from a JSON object of the same names (one clear error if bad)."""
    from pipeline.common import UserError
    kernels = {"FORWARD": FORWARD, "BACKWARD_KV": BACKWARD_KV, "BACKWARD_Q": BACKWARD_Q}
    try:
        settings = json.loads(raw)
        if not isinstance(settings, dict) or any(name not in kernels or not isinstance(values, dict)
                                                 or set(values) - set(kernels[name]) for name, values in
                                                 settings.items()):
            raise ValueError(f"expected {{kernel: {{setting: int}}}} with kernels {sorted(kernels)}")
    except ValueError as error:
        raise UserError(f"{SETTINGS_VARIABLE}={raw!r}: {error}; unset it or fix it "
                        f"(e.g. '{{\"FORWARD\": {{\"BLOCK_N\": 128}}}}')") from None
    for name, values in settings.items():
        kernels[name].update({key: int(value) for key, value in values.items()})


if os.environ.get(SETTINGS_VARIABLE):
    _apply_settings(os.environ[SETTINGS_VARIABLE])


@triton.jit
def _head_of_program(num_heads):
    """(b * H + h, b as int64, h) of this program: grid axis 1 walks batch rows and heads."""
    bh = tl.program_id(1)
    return bh, (bh // num_heads).to(tl.int64), bh % num_heads


@triton.jit
def _head_pointers(QKV, BIAS, KEY_BIAS, stride_b, stride_bias_h, stride_kb, num_heads, length,
                   HEAD_DIM: tl.constexpr):
    """(b * H + h, b, h) of this program and its pointers: its head's q in QKV (k and v follow H * HEAD_DIM and
    twice that further on), its head's bias at offset 0 and its batch row's key bias."""
    bh, b, h = _head_of_program(num_heads)
    return (bh, b, h, QKV + b * stride_b + h * HEAD_DIM, BIAS + h * stride_bias_h + length - 1,
            KEY_BIAS + b * stride_kb)


@triton.jit
def _load_rows(base, rows, stride, length, HEAD_DIM: tl.constexpr, EVEN: tl.constexpr):
    """[rows, HEAD_DIM] of one head from a [L, ...] layout whose rows are `stride` apart; zeros past `length` (EVEN:
    every row is inside it, no mask)."""
    pointers = base + rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
    if EVEN:
        return tl.load(pointers)
    return tl.load(pointers, mask=rows[:, None] < length, other=0.0)


@triton.jit
def _store_rows(base, rows, stride, length, values, HEAD_DIM: tl.constexpr, EVEN: tl.constexpr):
    pointers = base + rows[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
    if EVEN:
        tl.store(pointers, values.to(base.dtype.element_ty))
    else:
        tl.store(pointers, values.to(base.dtype.element_ty), mask=rows[:, None] < length)


@triton.jit
def _load_vector(base, index, length, EVEN: tl.constexpr):
    """base[index] in fp32, zeros past `length` (EVEN: no mask)."""
    if EVEN:
        return tl.load(base + index)
    return tl.load(base + index, mask=index < length, other=0.0)


@triton.jit
def _store_vector(base, index, length, values, EVEN: tl.constexpr):
    """base[index] = values where index < `length` (EVEN: every index is, no mask)."""
    if EVEN:
        tl.store(base + index, values)
    else:
        tl.store(base + index, values, mask=index < length)


@triton.jit
def _scores(a, b, bias_row, key_bias_row, query_idx, key_idx, length, far_bias,
            CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr,
            FAR: tl.constexpr):
    """a @ b^T plus the position bias (and the key bias) of each (query, key) of the tile, -inf where a key may not
    be seen: past the length (not with EVEN: the length is a whole number of blocks) and, in the decoder, after the
    query. query_idx and key_idx are broadcast to the tile: [M, 1] and [1, N] for a [queries, keys] tile, [1, M]
    and [N, 1] for a [keys, queries] one. Rows of queries past the length get finite scores (never stored). FAR: every
    offset of the tile lies in one saturated range, whose one bias value is `far_bias` (no per-score load)."""
    s = tl.dot(a, tl.trans(b), input_precision=PRECISION)
    if FAR:
        s += far_bias
    elif EVEN:
        s += tl.load(bias_row + key_idx - query_idx)
    else:
        s += tl.load(bias_row + key_idx - query_idx, mask=(key_idx < length) & (query_idx < length), other=0.0)
    if HAS_KEY_BIAS:
        s += _load_vector(key_bias_row, key_idx, length, EVEN)
    if CAUSAL:
        s = tl.where(key_idx <= query_idx, s, float("-inf"))
    if not EVEN:
        s = tl.where(key_idx < length, s, float("-inf"))
    return s


@triton.jit
def _near_range(start, end, saturate, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SATURATE: tl.constexpr):
    """[near_start, near_end) of the blocks (BLOCK_N wide, from 0 to end) whose tiles with the block [start, start +
    BLOCK_M) of the other side hold some offset inside (-saturate, saturate); every offset of a tile with a block
    before that range is on one side of it (<= -saturate from a query block: its keys; >= saturate from a key
    block: its queries), after it on the other. The range is symmetric, so one rule serves both passes. Without
    SATURATE, every block."""
    if SATURATE:
        near_start = tl.minimum(tl.maximum(start + 1 - saturate, 0) // BLOCK_N * BLOCK_N, end)
        near_end = tl.minimum((start + BLOCK_M - 1 + saturate + BLOCK_N - 1) // BLOCK_N * BLOCK_N, end)
        return near_start, tl.maximum(near_start, near_end)
    else:
        return 0, end


@triton.jit
def _far_biases(bias_row, saturate, SATURATE: tl.constexpr):
    """The bias of the saturated ranges (every offset >= saturate, every offset <= -saturate); zeros (unread)
    without SATURATE."""
    if SATURATE:
        return tl.load(bias_row + saturate), tl.load(bias_row - saturate)
    else:
        return 0.0, 0.0


@triton.jit
def _attn_fwd_kernel(QKV, BIAS, KEY_BIAS, OUT, LSE,
                     stride_b, stride_l, stride_ob, stride_ol, stride_bias_h, stride_kb, stride_lse_bh,
                     num_heads, length,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """One program: BLOCK_M queries of one (batch row, head), every key block, online softmax in base 2 (the
    scores' scale folded into the exponent's fused multiply-add). The bias is loaded per score in every tile: the
    backward's far path (one value per saturated range) made this kernel slower, split into three loops (0.414
    against 0.329 ms for mt5-large's encoder on an H200; docs/model.md)."""
    bh, b, h, base, bias_row, key_bias_row = _head_pointers(QKV, BIAS, KEY_BIAS, stride_b, stride_bias_h, stride_kb,
                                                            num_heads, length, HEAD_DIM)
    start_m = tl.program_id(0) * BLOCK_M
    queries = start_m + tl.arange(0, BLOCK_M)
    inner = num_heads * HEAD_DIM
    q = _load_rows(base, queries, stride_l, length, HEAD_DIM, EVEN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end_n = start_m + BLOCK_M if CAUSAL else length   # causal: the keys up to the last query; masked past length
    for start_n in range(0, end_n, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(base + inner, keys, stride_l, length, HEAD_DIM, EVEN)
        v = _load_rows(base + 2 * inner, keys, stride_l, length, HEAD_DIM, EVEN)
        s = _scores(q, k, bias_row, key_bias_row, queries[:, None], keys[None, :], length, 0.0,
                    CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, False)
        m_new = tl.maximum(m_i, tl.max(s, 1) * LOG2E)
        p = tl.exp2(s * LOG2E - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    _store_rows(OUT + b * stride_ob + h * HEAD_DIM, queries, stride_ol, length, acc / l_i[:, None], HEAD_DIM, EVEN)
    _store_vector(LSE + bh * stride_lse_bh, queries, length, m_i + tl.log2(l_i), EVEN)


@triton.jit
def _probabilities(s, lse, query_idx, length, EVEN: tl.constexpr):
    """The softmax's probabilities of a score tile from the forward's log-sum-exp (base 2); zero for queries past
    the length (their lse is not stored), which EVEN has none of."""
    p = tl.exp2(s * LOG2E - lse)
    if not EVEN:
        p = tl.where(query_idx < length, p, 0.0)
    return p


@triton.jit
def _kv_tile(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys, start_m, stride_l,
             stride_ol, length, inner, far_bias, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr, FAR: tl.constexpr):
    """One [keys, queries] tile of the key-block pass: dk and dv with the tile's terms added, and the tile's score
    gradient ds_t (for the bias gradient). FAR: the tile's bias is the one value `far_bias` (`_scores`)."""
    queries = start_m + tl.arange(0, BLOCK)
    q = _load_rows(base, queries, stride_l, length, HEAD_DIM, EVEN)
    do = _load_rows(dout_base, queries, stride_ol, length, HEAD_DIM, EVEN)
    lse = _load_vector(lse_row, queries, length, EVEN)
    delta = _load_vector(delta_row, queries, length, EVEN)
    s_t = _scores(k, q, bias_row, key_bias_row, queries[None, :], keys[:, None], length, far_bias,
                  CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, FAR)             # [keys, queries]
    p_t = _probabilities(s_t, lse[None, :], queries[None, :], length, EVEN)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv, ds_t


@triton.jit
def _kv_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys, start, end, stride_l,
              stride_ol, length, inner, far_bias, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr, FAR: tl.constexpr):
    """The key-block pass over query blocks [start, end) without the bias gradient: dk and dv with their terms."""
    for start_m in range(start, end, BLOCK):
        dk, dv, ds_t = _kv_tile(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                                start_m, stride_l, stride_ol, length, inner, far_bias, HEAD_DIM, BLOCK, CAUSAL,
                                HAS_KEY_BIAS, PRECISION, EVEN, FAR)
    return dk, dv


@triton.jit
def _far_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys, start, end,
               diagonal_row, top, carried, stride_l, stride_ol, length, inner, far_bias, HEAD_DIM: tl.constexpr,
               BLOCK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr,
               EVEN: tl.constexpr):
    """The key-block pass over query blocks [start, end) whose tiles lie wholly in one saturated range (bias
    `far_bias`): dk and dv with their terms added, and each tile's score gradient summed whole (row sums, returned
    as a vector). Each tile's slots in the diagonal row get what is carried to it (the diagonals of the tile before
    it, zeros after a far tile); returns dk, dv, the sums and what is carried on (zeros once a tile ran)."""
    total = tl.zeros([BLOCK], tl.float32)
    for start_m in range(start, end, BLOCK):
        dk, dv, ds_t = _kv_tile(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                                start_m, stride_l, stride_ol, length, inner, far_bias, HEAD_DIM, BLOCK, CAUSAL,
                                HAS_KEY_BIAS, PRECISION, EVEN, True)
        total += tl.sum(ds_t, 1)
        tl.store(diagonal_row + top - start_m, carried)
        carried = tl.zeros([BLOCK], tl.float32)
    return dk, dv, total, carried


@triton.jit
def _attn_bwd_kv_kernel(QKV, BIAS, KEY_BIAS, DOUT, LSE, DELTA, DQKV, DIAGONALS, SATURATED,
                        stride_b, stride_l, stride_db, stride_dl, stride_ob, stride_ol, stride_bias_h, stride_kb,
                        stride_lse_bh, num_heads, length, num_blocks, saturate,
                        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CAUSAL: tl.constexpr,
                        HAS_KEY_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, SATURATE: tl.constexpr,
                        PRECISION: tl.constexpr, EVEN: tl.constexpr):
    """One program: BLOCK keys of one (batch row, head), every query block: dk, dv, and the sums of the score
    gradient along each diagonal (one key - query offset each) over its tiles. DIAGONALS [B, H, key blocks, P +
    BLOCK] (P: the length padded to BLOCK) holds them at index offset - start_n + P - 1: the program's offsets fill
    its row exactly. A tile's diagonals at offsets up to 0 from its corner fall where the next tile's others do, so
    each is carried to the next tile and stored once, added (causal: zeros where tiles above the diagonal are
    skipped). BIAS_GRAD off: none written.

    SATURATE: tiles far enough off the diagonal (`_near_range`) have every offset in a saturated range (all >= the
    caller's `saturate`, or all <= -saturate), where the bias has one value; such a tile adds that value (no
    per-score load), and with BIAS_GRAD its gradient is summed whole instead of along its diagonals (its slots in
    the row get zeros) and the program's two sums go to SATURATED [B, H, key blocks, 2] (the range above, the range
    below)."""
    bh, b, h, base, bias_row, key_bias_row = _head_pointers(QKV, BIAS, KEY_BIAS, stride_b, stride_bias_h, stride_kb,
                                                            num_heads, length, HEAD_DIM)
    block_n = tl.program_id(0)
    start_n = block_n * BLOCK
    keys = start_n + tl.arange(0, BLOCK)
    inner = num_heads * HEAD_DIM
    dout_base = DOUT + b * stride_ob + h * HEAD_DIM
    lse_row = LSE + bh * stride_lse_bh
    delta_row = DELTA + bh * stride_lse_bh
    k = _load_rows(base + inner, keys, stride_l, length, HEAD_DIM, EVEN)
    v = _load_rows(base + 2 * inner, keys, stride_l, length, HEAD_DIM, EVEN)
    dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    first_m = start_n if CAUSAL else 0             # causal: the tiles above the diagonal are all masked
    # the query blocks of this key block: far above the diagonal (key - query >= saturate in every score), near it,
    # far below (<= -saturate); without SATURATE all are near
    near_start, near_end = _near_range(start_n, length, saturate, BLOCK, BLOCK, SATURATE)
    near_start = tl.maximum(first_m, near_start)
    near_end = tl.maximum(near_start, near_end)
    far_above, far_below = _far_biases(bias_row, saturate, SATURATE)
    if BIAS_GRAD:
        rows = tl.arange(0, BLOCK)[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        skew = (rows + cols) % BLOCK                 # skewed[r, c] = tile[r, (r + c) % BLOCK]
        wrapped = rows + cols >= BLOCK
        padded = num_blocks * BLOCK
        program = (b * num_heads + h) * num_blocks + block_n
        diagonal_row = DIAGONALS + program * (padded + BLOCK)
        # where tile 0's diagonals after its corner go (tile m's: start_m lower)
        top = padded + BLOCK - 1 - tl.arange(0, BLOCK)
        for start_m in range(0, first_m, BLOCK):
            tl.store(diagonal_row + top - start_m, tl.zeros([BLOCK], tl.float32))
        carried = tl.zeros([BLOCK], tl.float32)        # the previous tile's diagonals up to its corner
        dk, dv, above, carried = _far_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv,
                                            keys, first_m, near_start, diagonal_row, top, carried, stride_l,
                                            stride_ol, length, inner, far_above, HEAD_DIM, BLOCK,
                                            CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN)
        for start_m in range(near_start, near_end, BLOCK):
            dk, dv, ds_t = _kv_tile(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                                    start_m, stride_l, stride_ol, length, inner, 0.0, HEAD_DIM, BLOCK, CAUSAL,
                                    HAS_KEY_BIAS, PRECISION, EVEN, False)
            # the diagonals of ds_t: skewed[r, c] = ds_t[r, (r + c) % BLOCK] has key - query offset -c where r + c <
            # BLOCK, BLOCK - c where it wrapped; column sums of each part are the diagonal sums
            skewed = tl.gather(ds_t, skew, axis=1)
            below = tl.sum(tl.where(wrapped, 0.0, skewed), 0)              # offset corner - c
            upper = tl.sum(tl.where(wrapped, skewed, 0.0), 0)              # offset corner + BLOCK - c (0 at c = 0)
            tl.store(diagonal_row + top - start_m, carried + upper)        # the previous tile's corner - c: the same
            carried = below
        dk, dv, under, carried = _far_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv,
                                            keys, near_end, length, diagonal_row, top, carried, stride_l, stride_ol,
                                            length, inner, far_below, HEAD_DIM, BLOCK, CAUSAL,
                                            HAS_KEY_BIAS, PRECISION, EVEN)
        tl.store(diagonal_row + top - padded, carried)
        if SATURATE:
            tl.store(SATURATED + 2 * program, tl.sum(above, 0))
            tl.store(SATURATED + 2 * program + 1, tl.sum(under, 0))
    else:
        if SATURATE:
            dk, dv = _kv_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                               first_m, near_start, stride_l, stride_ol, length, inner, far_above, HEAD_DIM, BLOCK,
                               CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, True)
        dk, dv = _kv_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                           near_start, near_end, stride_l, stride_ol, length, inner, 0.0, HEAD_DIM, BLOCK, CAUSAL,
                           HAS_KEY_BIAS, PRECISION, EVEN, False)
        if SATURATE:
            dk, dv = _kv_tiles(base, dout_base, bias_row, key_bias_row, lse_row, delta_row, k, v, dk, dv, keys,
                               near_end, length, stride_l, stride_ol, length, inner, far_below, HEAD_DIM, BLOCK,
                               CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, True)
    grad_base = DQKV + b * stride_db + h * HEAD_DIM
    _store_rows(grad_base + inner, keys, stride_dl, length, dk, HEAD_DIM, EVEN)
    _store_rows(grad_base + 2 * inner, keys, stride_dl, length, dv, HEAD_DIM, EVEN)


@triton.jit
def _q_tiles(q, do, lse, delta, dq, base, bias_row, key_bias_row, queries, start, end, far_bias, stride_l, length,
             inner, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr,
             PRECISION: tl.constexpr, EVEN: tl.constexpr, FAR: tl.constexpr):
    """The query-block pass over key blocks [start, end): dq with their terms added."""
    for start_n in range(start, end, BLOCK_N):
        keys = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(base + inner, keys, stride_l, length, HEAD_DIM, EVEN)
        v = _load_rows(base + 2 * inner, keys, stride_l, length, HEAD_DIM, EVEN)
        s = _scores(q, k, bias_row, key_bias_row, queries[:, None], keys[None, :], length, far_bias,
                    CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, FAR)
        p = _probabilities(s, lse[:, None], queries[:, None], length, EVEN)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _attn_bwd_q_kernel(QKV, BIAS, KEY_BIAS, DOUT, LSE, DELTA, DQKV,
                       stride_b, stride_l, stride_db, stride_dl, stride_ob, stride_ol, stride_bias_h, stride_kb,
                       stride_lse_bh, num_heads, length, saturate,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                       EVEN: tl.constexpr, SATURATE: tl.constexpr):
    """One program: BLOCK_M queries of one (batch row, head), every key block: dq. SATURATE: key blocks whose every
    offset lies in a saturated range (`_near_range`) add that range's one bias value instead of loading it per
    score."""
    bh, b, h, base, bias_row, key_bias_row = _head_pointers(QKV, BIAS, KEY_BIAS, stride_b, stride_bias_h, stride_kb,
                                                            num_heads, length, HEAD_DIM)
    start_m = tl.program_id(0) * BLOCK_M
    queries = start_m + tl.arange(0, BLOCK_M)
    inner = num_heads * HEAD_DIM
    q = _load_rows(base, queries, stride_l, length, HEAD_DIM, EVEN)
    do = _load_rows(DOUT + b * stride_ob + h * HEAD_DIM, queries, stride_ol, length, HEAD_DIM, EVEN)
    lse = _load_vector(LSE + bh * stride_lse_bh, queries, length, EVEN)
    delta = _load_vector(DELTA + bh * stride_lse_bh, queries, length, EVEN)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    end_n = start_m + BLOCK_M if CAUSAL else length   # causal: the keys up to the last query; masked past length
    near_start, near_end = _near_range(start_m, end_n, saturate, BLOCK_M, BLOCK_N, SATURATE)
    far_above, far_below = _far_biases(bias_row, saturate, SATURATE)
    if SATURATE:
        dq = _q_tiles(q, do, lse, delta, dq, base, bias_row, key_bias_row, queries, 0, near_start, far_below,
                      stride_l, length, inner, HEAD_DIM, BLOCK_N, CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, True)
    dq = _q_tiles(q, do, lse, delta, dq, base, bias_row, key_bias_row, queries, near_start, near_end, 0.0,
                  stride_l, length, inner, HEAD_DIM, BLOCK_N, CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, False)
    if SATURATE:
        dq = _q_tiles(q, do, lse, delta, dq, base, bias_row, key_bias_row, queries, near_end, end_n, far_above,
                      stride_l, length, inner, HEAD_DIM, BLOCK_N, CAUSAL, HAS_KEY_BIAS, PRECISION, EVEN, True)
    _store_rows(DQKV + b * stride_db + h * HEAD_DIM, queries, stride_dl, length, dq, HEAD_DIM, EVEN)


@triton.jit
def _attn_bwd_delta_kernel(OUT, DOUT, DELTA, stride_ob, stride_ol, stride_lse_bh, num_heads, length,
                           HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    """delta[b, h, i] = sum_d out[b, i, h, d] * dout[b, i, h, d] in fp32 (the softmax backward's row term)."""
    bh, b, h = _head_of_program(num_heads)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offset = b * stride_ob + h * HEAD_DIM
    out = _load_rows(OUT + offset, rows, stride_ol, length, HEAD_DIM, EVEN).to(tl.float32)
    dout = _load_rows(DOUT + offset, rows, stride_ol, length, HEAD_DIM, EVEN).to(tl.float32)
    _store_vector(DELTA + bh * stride_lse_bh, rows, length, tl.sum(out * dout, 1), EVEN)


# ------------------------------------------------------------------------------------------- the ops

def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 (the tests compare against fp32 references); bf16/fp16 as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _sum_diagonals(diagonals: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """[H, 2L - 1] bias gradient (offsets -(L-1)..L-1) of the kernel's rows [B, H, key blocks, P + BLOCK], key block
    n's at offset - n * BLOCK + P - 1: summed over batch rows, then each key block's row shifted by n * BLOCK and
    summed, by padding each row with P zeros and reading the flat rows P + BLOCK shorter (row n then starts n * BLOCK
    later). Fixed-order sums, no atomics: the same bits every run."""
    per_block = diagonals.sum(0)                                       # [H, n, P + BLOCK]
    heads, num_blocks, width = per_block.shape
    padded = width - block
    shifted = F.pad(per_block, (0, padded)).view(heads, -1)[:, :num_blocks * 2 * padded]
    return shifted.view(heads, num_blocks, 2 * padded).sum(1)[:, padded - length: padded + length - 1].contiguous()


def _far_blocks(saturate: int, block: int, num_blocks: int) -> int:
    """How many blocks off the diagonal a [block x block] score tile must be for every key - query offset in it to
    be >= saturate (or <= -saturate): offsets in the tile k blocks off span k * block -+ (block - 1). num_blocks (no
    tile is that far) when saturate is 0 or no tile is far enough."""
    if saturate <= 0:
        return num_blocks
    return min(num_blocks, (saturate + 2 * block - 2) // block)


def _even(length: int, *blocks: int) -> bool:
    """Whether `length` is a whole number of each block: the kernels then load, store and score without masks."""
    return all(length % block == 0 for block in blocks)


def _key_bias_args(key_bias: torch.Tensor | None, like: torch.Tensor):
    """(tensor, batch stride, present) of the optional additive key bias [B, L] fp32."""
    if key_bias is None:
        return like, 0, False
    return key_bias, key_bias.stride(0), True


@torch.library.custom_op("t5zero::relative_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, bias_by_offset: torch.Tensor, key_bias: torch.Tensor | None, num_heads: int,
             causal: bool, saturate: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, width = qkv.shape
    head_dim = width // (3 * num_heads)
    out = qkv.new_empty(batch, length, num_heads * head_dim)
    lse = torch.empty(batch, num_heads, length, dtype=torch.float32, device=qkv.device)
    key_bias_arg, stride_kb, has_key_bias = _key_bias_args(key_bias, bias_by_offset)
    config = dict(FORWARD)
    grid = (triton.cdiv(length, config["BLOCK_M"]), batch * num_heads)
    _attn_fwd_kernel[grid](qkv, bias_by_offset, key_bias_arg, out, lse,
                           qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1), bias_by_offset.stride(0),
                           stride_kb, lse.stride(1), num_heads, length,
                           HEAD_DIM=head_dim, CAUSAL=causal, HAS_KEY_BIAS=has_key_bias,
                           PRECISION=_precision(qkv.dtype), EVEN=_even(length, config["BLOCK_M"], config["BLOCK_N"]),
                           **config)
    return out, lse


@_forward.register_fake
def _(qkv, bias_by_offset, key_bias, num_heads, causal, saturate):
    batch, length, width = qkv.shape
    return (qkv.new_empty(batch, length, width // 3),
            qkv.new_empty(batch, num_heads, length, dtype=torch.float32))


@torch.library.custom_op("t5zero::relative_attention_backward", mutates_args=())
def _backward(dout: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
              bias_by_offset: torch.Tensor, key_bias: torch.Tensor | None, num_heads: int, causal: bool,
              bias_grad: bool, saturate: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length, width = qkv.shape
    head_dim = width // (3 * num_heads)
    dout = dout.contiguous()                      # the same [B, L, H * D] layout as out
    delta = torch.empty_like(lse)                 # [B, H, L] fp32: rowsum(dO * O)
    _attn_bwd_delta_kernel[(triton.cdiv(length, 64), batch * num_heads)](
        out, dout, delta, out.stride(0), out.stride(1), lse.stride(1), num_heads, length, HEAD_DIM=head_dim, BLOCK=64,
        EVEN=_even(length, 64))
    dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    key_bias_arg, stride_kb, has_key_bias = _key_bias_args(key_bias, bias_by_offset)
    kv_config, q_config = dict(BACKWARD_KV), dict(BACKWARD_Q)
    block = kv_config["BLOCK"]
    num_blocks = triton.cdiv(length, block)
    padded = num_blocks * block
    diagonals = torch.empty((batch, num_heads, num_blocks, padded + block) if bias_grad else (1,),
                            dtype=torch.float32, device=qkv.device)     # every element written by the kernel
    far_blocks = _far_blocks(saturate, block, num_blocks)
    saturating = far_blocks < num_blocks             # some tile lies in a saturated range (its gradient summed whole)
    saturated = torch.empty((batch, num_heads, num_blocks, 2) if bias_grad and saturating else (1,),
                            dtype=torch.float32, device=qkv.device)
    common = dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_KEY_BIAS=has_key_bias, PRECISION=_precision(qkv.dtype))
    kv_config.update(BIAS_GRAD=bias_grad, SATURATE=saturating)
    strides = (qkv.stride(0), qkv.stride(1), dqkv.stride(0), dqkv.stride(1), dout.stride(0), dout.stride(1),
               bias_by_offset.stride(0), stride_kb, lse.stride(1))
    _attn_bwd_kv_kernel[(num_blocks, batch * num_heads)](
        qkv, bias_by_offset, key_bias_arg, dout, lse, delta, dqkv, diagonals, saturated, *strides, num_heads, length,
        num_blocks, saturate, **common, EVEN=_even(length, block), **kv_config)
    _attn_bwd_q_kernel[(triton.cdiv(length, q_config["BLOCK_M"]), batch * num_heads)](
        qkv, bias_by_offset, key_bias_arg, dout, lse, delta, dqkv, *strides, num_heads, length, saturate,
        **common, EVEN=_even(length, q_config["BLOCK_M"], q_config["BLOCK_N"]), SATURATE=0 < saturate < length,
        **q_config)
    if not bias_grad:
        return dqkv, torch.zeros_like(bias_by_offset)
    dbias = _sum_diagonals(diagonals, length, block)
    if saturating:                 # each saturated range's sum, at its first offset
        far = saturated.sum((0, 2))                                    # [H, 2]: above, below
        dbias[:, length - 1 + saturate] += far[:, 0]
        dbias[:, length - 1 - saturate] += far[:, 1]
    return dqkv, dbias


@_backward.register_fake
def _(dout, qkv, out, lse, bias_by_offset, key_bias, num_heads, causal, bias_grad, saturate):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format), torch.empty_like(bias_by_offset)


def _setup_context(ctx, inputs, output):
    qkv, bias_by_offset, key_bias, num_heads, causal, saturate = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, bias_by_offset, key_bias)
    ctx.num_heads, ctx.causal, ctx.saturate = num_heads, causal, saturate


def _autograd_backward(ctx, dout, dlse):
    qkv, out, lse, bias_by_offset, key_bias = ctx.saved_tensors
    dqkv, dbias = _backward(dout, qkv, out, lse, bias_by_offset, key_bias, ctx.num_heads, ctx.causal,
                            ctx.needs_input_grad[1], ctx.saturate)
    return dqkv, dbias if ctx.needs_input_grad[1] else None, None, None, None, None


torch.library.register_autograd("t5zero::relative_attention_forward", _autograd_backward,
                                setup_context=_setup_context)


def relative_attention(qkv: torch.Tensor, bias_by_offset: torch.Tensor, num_heads: int, causal: bool = False,
                       key_bias: torch.Tensor | None = None, saturate: int = 0) -> torch.Tensor:
    """softmax(q k^T + bias, causal-masked) v for the fused projection qkv [B, L, 3 * H * D] (q|k|v, heads inside
    each); bias_by_offset [H, 2L - 1] fp32 (index j - i + L - 1), key_bias [B, L] fp32 added to every query's
    scores (a padding mask), or None. Returns [B, L, H * D] in qkv's dtype.

    saturate > 0 says that bias_by_offset has one value per head at every offset >= saturate and one at every offset
    <= -saturate (T5's last buckets: `RelativePositionBias.saturate`). The bias gradient of each such range is then
    exact as a sum only, and so what reaches the bucket table is exact: score tiles with every offset in one range
    are summed whole, not along their diagonals, and their sum is put at the range's first offset. The backward
    passes read each range's bias at its first offset for such tiles (the forward reads every score's own)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _forward(qkv, bias_by_offset.float().contiguous(),
                    None if key_bias is None else key_bias.float().contiguous(), num_heads, causal, saturate)[0]
