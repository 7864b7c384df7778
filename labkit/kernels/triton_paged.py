"""The Triton kernels of the paged cache: where the block table meets the hardware (chapter 03, appendix A1).

A paged KV cache stores every layer's keys and values in one pool of blocks,
``k_cache`` and ``v_cache`` shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Sequence ``i`` owns the blocks listed in row ``i`` of ``block_tables`` (int32
``[num_seqs, max_blocks_per_seq]``); its token at position ``p`` lives in block
``block_tables[i, p // block_size]`` at offset ``p % block_size``. ``seq_lens``
(int32 ``[num_seqs]``) says how many positions of each sequence are valid.
Entries of a block table past ``ceil(seq_len / block_size)`` are never read.

* ``write_kv_kernel`` scatters the new tokens' K and V into their slots
  (``slot = block_id * block_size + offset``; slot -1 means "skip this token"), and
  ``write_kv_quant_kernel`` does it for a quantized pool, computing the scales as it writes.
* ``paged_decode_kernel``: one new query per sequence attends over all of its cached
  positions. Each program serves one (sequence, KV head) pair and all the query heads that
  share that KV head (GQA), walking the block table ``BLOCK_N`` tokens at a time with an online
  softmax. For long contexts with few sequences the walk is split into chunks processed in
  parallel (flash-decoding, "split-K"), merged by their log-sum-exp (``merge_splits_kernel``).
* ``paged_prefill_kernel``: many new queries per sequence (a prompt, a chunk of a prompt, or the
  suffix after a prefix-cache hit), causal, reading earlier positions from the paged cache.

Every load is upcast to float32 before arithmetic where the launch asks for it (``UPCAST``): the
interpreter's bfloat16 is wrong otherwise. The interpreter's fp8 is wrong about NaN too (it reads
e4m3fn's NaN, 0x7F, as 480, and writes NaN as 384): there (``FP8_NAN_BY_BITS``) the kernels read
NaN from the bits themselves; a GPU's conversion gets it right, and pays nothing for it. Paging
changes *where* K and V live, not what attention computes: no element is compressed and no position
is skipped. How the kernels are launched (tiles, warps, stages, splits) is ``labkit.kernels.launch``;
what they must compute is ``labkit.kernels.reference``.
"""

from __future__ import annotations

from ..memory.formats import GROUP_SIZE, KVQuant

try:  # Triton is optional: without it the public functions use the references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


# How a kernel reads the pool (KV_FORMAT) and where its scales live (SCALES): tl.constexpr codes.
KV_FORMATS = {None: 0, "fp8": 1, "int8": 2, "int4": 3}
SCALE_KINDS = {"tensor": 0, "block": 1, "group": 2}


def format_constexprs(kq: KVQuant | None, interpreted: bool) -> dict:
    """The quantization constexprs of the attention kernels (a 16/32-bit pool: KV_FORMAT 0). ``interpreted``:
    Triton's interpreter, whose fp8 NaN the kernels read from the bits (``FP8_NAN_BY_BITS``)."""
    if kq is None:
        return dict(KV_FORMAT=0, SCALES=0, GROUP_SIZE=GROUP_SIZE, FP8_NAN_BY_BITS=False)
    return dict(KV_FORMAT=KV_FORMATS[kq.element], SCALES=SCALE_KINDS[kq.scales], GROUP_SIZE=kq.group_size,
                FP8_NAN_BY_BITS=interpreted and kq.element == "fp8")


if triton is not None:

    @triton.jit
    def _round_half_even(x):
        """Nearest integer, ties to the even one, as torch.round: floor, then one up past one half."""
        r = tl.floor(x)
        f = x - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)

    @triton.jit
    def _fp8_to_float(codes, NAN_BY_BITS: tl.constexpr):
        """fp8 e4m3fn codes as float32. ``NAN_BY_BITS`` (the interpreter, which would read 480): NaN, the bits
        x1111111, found from the bits; a GPU's conversion already gives NaN."""
        if NAN_BY_BITS:
            nan = (codes.to(tl.uint8, bitcast=True) & 127) == 127
            x = tl.where(nan, float("nan"), codes.to(tl.float32))
        else:
            x = codes.to(tl.float32)
        return x

    @triton.jit
    def _load_dequantized(cache_ptr, scale_ptr, block_id, offset, kv_head, valid, head_dim,
                          stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                          KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          FP8_NAN_BY_BITS: tl.constexpr):
        """K or V of BLOCK_N positions as float32 [BLOCK_N, BLOCK_D]: load the codes, times their scales.

        ``block_id`` and ``offset`` [BLOCK_N] locate each position; masked positions read code 0 and
        scale 0 (the caller masks them again). Every load is of consecutive addresses. int4: a row's
        BLOCK_D / 2 bytes, each split into its low nibble (element 2i) and high one (2i + 1), stored
        as code + 8, then interleaved back (``tl.join``). Group scales: BLOCK_D / GROUP_SIZE per row,
        each widened over its group.
        """
        row = block_id.to(tl.int64) * stride_cb + offset * stride_cs + kv_head * stride_ch
        if KV_FORMAT == 3:
            i = tl.arange(0, BLOCK_D // 2)
            mask = valid[:, None] & (i < head_dim // 2)[None, :]
            byte = tl.load(cache_ptr + row[:, None] + i[None, :], mask=mask, other=8).to(tl.int32)
            x = tl.reshape(tl.join((byte & 15) - 8, (byte >> 4) - 8), [BLOCK_N, BLOCK_D]).to(tl.float32)
        else:
            d = tl.arange(0, BLOCK_D)
            mask = valid[:, None] & (d < head_dim)[None, :]
            if KV_FORMAT == 1:
                codes = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0.0)
                x = _fp8_to_float(codes, FP8_NAN_BY_BITS)
            else:
                x = tl.load(cache_ptr + row[:, None] + d[None, :], mask=mask, other=0).to(tl.float32)
        if SCALES == 0:  # one scale for the whole layer
            x = x * tl.load(scale_ptr)
        elif SCALES == 1:  # one per (block, KV head)
            s = tl.load(scale_ptr + block_id.to(tl.int64) * stride_sb + kv_head * stride_sh, mask=valid, other=0.0)
            x = x * s[:, None]
        else:  # one per group of GROUP_SIZE elements of each position
            NUM_G: tl.constexpr = BLOCK_D // GROUP_SIZE if BLOCK_D > GROUP_SIZE else 1
            g = tl.arange(0, NUM_G)
            srow = block_id.to(tl.int64) * stride_sb + offset * stride_ss + kv_head * stride_sh
            s = tl.load(scale_ptr + srow[:, None] + g[None, :], mask=valid[:, None] & (g * GROUP_SIZE < head_dim)[None, :],
                        other=0.0)
            x = x * tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, NUM_G, BLOCK_D // NUM_G]), [BLOCK_N, BLOCK_D])
        return x

    @triton.jit
    def _round_to_e4m3(y):
        """|y| <= 448 rounded to the nearest fp8 e4m3 number, ties to even, still as float32.

        e4m3 keeps 3 mantissa bits, so between 2^e and 2^(e+1) its numbers are 2^(e-3) apart; below
        2^-6 (subnormal) they are 2^-9 apart. Read e from y's float32 bits, divide by the step (a
        power of two: exact), round, multiply back. The cast to float8e4nv that follows is then
        exact: Triton's interpreter rounds that cast wrongly when the rounding carries into the
        exponent (31.4 became 16, not 32), and a GPU rounds it as this does.
        """
        exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 255) - 127
        step = (((tl.maximum(exponent, -6) - 3) + 127) << 23).to(tl.float32, bitcast=True)
        return _round_half_even(y / step) * step

    @triton.jit
    def _saturate(y, QMAX: tl.constexpr, KV_FORMAT: tl.constexpr):
        """Values divided by their scale, clamped to ±qmax (±inf saturates there); NaN stays NaN for fp8
        (it has one) and becomes 0 for integer codes. ``labkit.memory.formats``' "Non-finite values"."""
        c = tl.minimum(tl.maximum(y, -QMAX), QMAX)  # what max/min do with NaN differs: set it below
        if KV_FORMAT == 1:
            c = tl.where(y != y, float("nan"), c)
        else:
            c = tl.where(y != y, 0.0, c)
        return c

    @triton.jit
    def _encode(y, KV_FORMAT: tl.constexpr):
        """Values already divided by their scale and saturated (``_saturate``), as fp8 or int8 codes.

        fp8: every NaN is stored as e4m3fn's positive NaN, 0x7F, written as bits (the interpreter's cast
        would write 384), as ``labkit.memory.formats.quantize`` stores it.
        """
        if KV_FORMAT == 1:
            nan = y != y
            bits = _round_to_e4m3(tl.where(nan, 0.0, y)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            code = tl.where(nan, 127, bits.to(tl.int32)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        else:
            code = _round_half_even(y).to(tl.int8)
        return code  # one return: a compiled jit function must return one type

    @triton.jit
    def _finite_abs(x):
        """|x| where x is finite, 0 for NaN and ±inf: what a scale is set from, so one bad element spoils
        no other element's code (NaN < inf is false)."""
        a = tl.abs(x)
        return tl.where(a < float("inf"), a, 0.0)

    @triton.jit
    def _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask,
                     STEP: tl.constexpr, FIRST: tl.constexpr):
        """New K or V rows [BLOCK_R, BLOCK_E] as float32: run row j is token order[start + j]; lane e
        holds element STEP * e + FIRST (int4: even elements, then odd ones)."""
        token = tl.load(order_ptr + start + j, mask=j_mask, other=0).to(tl.int64)
        ptr = x_ptr + token[:, None] * stride_xt + head * stride_xh + (STEP * e + FIRST)[None, :]
        return tl.load(ptr, mask=j_mask[:, None] & e_mask[None, :], other=0.0).to(tl.float32)

    @triton.jit
    def _group_scales(a, QMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, LANES: tl.constexpr):
        """Per-row scales of every LANES consecutive lanes of finite |values| ``a`` [BLOCK_R, BLOCK_E]: the group's
        max over qmax, as [BLOCK_R, BLOCK_E // LANES] and broadcast back to [BLOCK_R, BLOCK_E]."""
        g = tl.max(tl.reshape(a, [BLOCK_R, BLOCK_E // LANES, LANES]), axis=2) / QMAX
        wide = tl.reshape(tl.broadcast_to(g[:, :, None], [BLOCK_R, BLOCK_E // LANES, LANES]), [BLOCK_R, BLOCK_E])
        return g, wide

    @triton.jit
    def write_kv_quant_kernel(
        x_ptr, cache_ptr, scale_ptr, order_ptr, runs_ptr,
        stride_xt, stride_xh,
        stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, stride_sh,
        head_dim,
        QMAX: tl.constexpr, KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, FP8_NAN_BY_BITS: tl.constexpr,
    ):
        """One program per (run, KV head): quantize the new tokens of one run into one block of one pool.

        A run (a row of ``runs``: block id, first offset, start in ``order``, count) is the new
        tokens that land in consecutive slots of one block; row j of the run is token
        ``order[start + j]`` going to offset ``first + j``. Rows are handled BLOCK_R at a time;
        each lane of a row is one element (int4: one byte, i.e. elements 2e and 2e + 1).

        Per tensor: divide by the layer's fixed scale, clamp, round. Per group: each row's scales
        from its own values, stored beside it. Per block: first the new rows' max |x|; the block's
        scale becomes max(old, that / qmax), where the old one counts only when ``first`` > 0;
        the block's earlier rows are decoded with the old scale and encoded again with the new.

        Non-finite values, as ``labkit.memory.formats.write_quantized`` (the reference) stores them, bit
        for bit: scales come from the finite |x| only (``_finite_abs``); NaN is stored as int code 0 or
        fp8 NaN, ±inf saturates to ±qmax (``_saturate``).
        """
        run = tl.program_id(0)
        head = tl.program_id(1)
        block_id = tl.load(runs_ptr + run * 4).to(tl.int64)
        first = tl.load(runs_ptr + run * 4 + 1)
        start = tl.load(runs_ptr + run * 4 + 2)
        count = tl.load(runs_ptr + run * 4 + 3)
        STEP: tl.constexpr = 2 if KV_FORMAT == 3 else 1  # elements per lane
        LANES: tl.constexpr = GROUP_SIZE // STEP  # lanes per scale group
        r = tl.arange(0, BLOCK_R)
        e = tl.arange(0, BLOCK_E)
        e_mask = e < head_dim // STEP
        block_ptr = cache_ptr + block_id * stride_cb + head * stride_ch
        block_scale_ptr = scale_ptr + block_id * stride_sb + head * stride_sh

        if SCALES == 0:
            scale = tl.load(scale_ptr)
        elif SCALES == 1:
            old = tl.where(first > 0, tl.load(block_scale_ptr), 0.0)
            amax = tl.full([], 0.0, tl.float32)
            for j0 in range(0, count, BLOCK_R):
                j = j0 + r
                j_mask = j < count
                a = _finite_abs(_load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e,
                                             e_mask, STEP, 0))
                if KV_FORMAT == 3:
                    a = tl.maximum(a, _finite_abs(_load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt,
                                                               stride_xh, e, e_mask, STEP, 1)))
                amax = tl.maximum(amax, tl.max(tl.max(a, axis=1), axis=0))
            scale = tl.maximum(old, amax / QMAX)
            new_divisor = tl.where(scale > 0, scale, 1.0)
            for o0 in range(0, first, BLOCK_R):  # the block's earlier rows: decode, encode for the new scale
                o = o0 + r
                mask = (o < first)[:, None] & e_mask[None, :]
                ptr = block_ptr + o[:, None] * stride_cs + e[None, :]
                codes = tl.load(ptr, mask=mask)  # masked lanes are never stored
                if KV_FORMAT == 3:
                    byte = codes.to(tl.int32)
                    lo = ((byte & 15) - 8).to(tl.float32) * old / new_divisor
                    hi = ((byte >> 4) - 8).to(tl.float32) * old / new_divisor
                    packed = (_round_half_even(lo).to(tl.int32) + 8) | ((_round_half_even(hi).to(tl.int32) + 8) << 4)
                    tl.store(ptr, packed.to(tl.uint8), mask=mask)
                else:
                    if KV_FORMAT == 1:
                        values = _fp8_to_float(codes, FP8_NAN_BY_BITS)
                    else:
                        values = codes.to(tl.float32)
                    y = _saturate(values * old / new_divisor, QMAX, KV_FORMAT)
                    tl.store(ptr, _encode(y, KV_FORMAT), mask=mask)
            tl.store(block_scale_ptr, scale)

        for j0 in range(0, count, BLOCK_R):  # the new rows
            j = j0 + r
            j_mask = j < count
            mask = j_mask[:, None] & e_mask[None, :]
            offset = first + j
            ptr = block_ptr + offset[:, None] * stride_cs + e[None, :]
            lo = _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask, STEP, 0)
            if KV_FORMAT == 3:
                hi = _load_values(x_ptr, order_ptr, start, j, j_mask, head, stride_xt, stride_xh, e, e_mask, STEP, 1)
                a = tl.maximum(_finite_abs(lo), _finite_abs(hi))
            else:
                hi = lo
                a = _finite_abs(lo)
            if SCALES == 2:  # each row's own scales, one per LANES lanes, stored beside it
                g, s = _group_scales(a, QMAX, BLOCK_R, BLOCK_E, LANES)
                gi = tl.arange(0, BLOCK_E // LANES)
                row_scales = scale_ptr + block_id * stride_sb + offset * stride_ss + head * stride_sh
                tl.store(row_scales[:, None] + gi[None, :], g,
                         mask=j_mask[:, None] & (gi * GROUP_SIZE < head_dim)[None, :])
            else:
                s = tl.zeros([BLOCK_R, BLOCK_E], tl.float32) + scale
            divisor = tl.where(s > 0, s, 1.0)
            lo = _saturate(lo / divisor, QMAX, KV_FORMAT)
            if KV_FORMAT == 3:
                hi = _saturate(hi / divisor, QMAX, KV_FORMAT)
                packed = (_round_half_even(lo).to(tl.int32) + 8) | ((_round_half_even(hi).to(tl.int32) + 8) << 4)
                tl.store(ptr, packed.to(tl.uint8), mask=mask)
            else:
                tl.store(ptr, _encode(lo, KV_FORMAT), mask=mask)

    @triton.jit
    def write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_cs, stride_ch,
        num_kv_heads, head_dim, block_size,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per new token: copy its [num_kv_heads, head_dim] K and V into its slot."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        keep = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0  # slot -1: store nothing
        mask = (heads < num_kv_heads) & (dims < head_dim) & keep
        block_id = slot // block_size
        offset = slot % block_size
        dst = block_id * stride_cb + offset * stride_cs + heads * stride_ch + dims
        k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)

    @triton.jit
    def paged_decode_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
        stride_qs, stride_qh,
        stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, stride_sh,
        stride_bt,
        stride_os, stride_oh,
        stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
        qk_scale_log2,
        group_size, head_dim, block_size, tokens_per_split,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
        KV_FORMAT: tl.constexpr, SCALES: tl.constexpr, GROUP_SIZE: tl.constexpr, FP8_NAN_BY_BITS: tl.constexpr,
    ):
        """One program per (sequence, KV head, split): the group's queries against one stretch of keys.

        Step by step:
          1. load the ``group_size`` query heads that share this KV head: a [BLOCK_G, BLOCK_D] tile;
          2. walk the positions [lo, hi) ``BLOCK_N`` at a time; for each position look up its
             physical block in the block table and gather K and V rows from the pool;
          3. scores = q @ K^T, masked beyond seq_len; online softmax keeps a running maximum ``m``,
             a running denominator ``l`` and an unnormalised output ``acc``;
          4. without SPLIT write acc / l; with SPLIT write it plus log2-sum-exp for the merge kernel.

        A quantized pool (KV_FORMAT > 0) changes step 2 only: the K and V codes are multiplied by
        their scales right after the load (``_load_dequantized``), before the dot products.
        """
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        lo = split * tokens_per_split
        hi = tl.minimum(lo + tokens_per_split, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        q_head = kv_head * group_size + g  # the query heads of this KV head's group
        g_mask = g < group_size
        d_mask = d < head_dim  # head dims like 80 or 96 are padded to a power of two
        q = tl.load(q_ptr + seq * stride_qs + q_head[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        elif KV_FORMAT == 0:
            q = q.to(k_cache_ptr.dtype.element_ty)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + n
            valid = pos < hi
            # The paging: position -> (logical block, offset) -> physical block -> row of the pool.
            block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
            if KV_FORMAT == 0:
                row = block_id.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
            else:  # codes times scales, in float32; on tensor cores then rounded to q's 16-bit type
                k = _load_dequantized(k_cache_ptr, k_scale_ptr, block_id, pos % block_size, kv_head, valid, head_dim,
                                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                      BLOCK_N, BLOCK_D, KV_FORMAT, SCALES, GROUP_SIZE, FP8_NAN_BY_BITS)
                v = _load_dequantized(v_cache_ptr, v_scale_ptr, block_id, pos % block_size, kv_head, valid, head_dim,
                                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_sh,
                                      BLOCK_N, BLOCK_D, KV_FORMAT, SCALES, GROUP_SIZE, FP8_NAN_BY_BITS)
                if not UPCAST:
                    k = k.to(q_ptr.dtype.element_ty)
                    v = v.to(q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)  # rescale what was summed under the old maximum
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if SPLIT:
            # A split past the end of a short sequence saw no keys: l = 0, lse = -inf, weight 0 in the merge.
            has_keys = l_i > 0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            base = seq * stride_ps + q_head * stride_ph + split * stride_pk
            tl.store(part_out_ptr + base[:, None] + d[None, :], o, mask=out_mask)
            tl.store(part_lse_ptr + seq * stride_ls + q_head * stride_lh + split, lse, mask=g_mask)
        else:
            o = acc / l_i[:, None]
            tl.store(out_ptr + seq * stride_os + q_head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)

    @triton.jit
    def merge_splits_kernel(
        part_out_ptr, part_lse_ptr, out_ptr,
        stride_ps, stride_ph, stride_pk, stride_ls, stride_lh,
        stride_os, stride_oh,
        num_splits, head_dim,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One program per (sequence, query head): merge the splits' partial outputs.

        Split k holds o_k = (sum_j p_j v_j) / l_k and lse_k = log2(l_k) + m_k. The exact
        full softmax output is sum_k w_k o_k with w_k = 2^(lse_k - lse_max) / sum 2^(...).
        The splits are read ``BLOCK_K`` at a time with a running maximum, the online softmax
        once more, so any number of splits fits in a fixed tile. Split 0 always saw keys, so
        the running maximum is finite after the first chunk.
        """
        seq = tl.program_id(0)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        m_i = tl.full([], float("-inf"), dtype=tl.float32)
        l_i = tl.full([], 0.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for first in range(0, num_splits, BLOCK_K):
            k = first + tl.arange(0, BLOCK_K)
            k_mask = k < num_splits
            lse = tl.load(part_lse_ptr + seq * stride_ls + head * stride_lh + k, mask=k_mask, other=float("-inf"))
            o = tl.load(part_out_ptr + seq * stride_ps + head * stride_ph + k[:, None] * stride_pk + d[None, :],
                        mask=k_mask[:, None] & (d[None, :] < head_dim), other=0.0)
            m_new = tl.maximum(m_i, tl.max(lse, axis=0))
            alpha = tl.exp2(m_i - m_new)
            w = tl.exp2(lse - m_new)
            l_i = l_i * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
            m_i = m_new
        tl.store(out_ptr + seq * stride_os + head * stride_oh + d, (acc / l_i).to(out_ptr.dtype.element_ty),
                 mask=d < head_dim)

    @triton.jit
    def paged_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
        stride_qt, stride_qh,
        stride_cb, stride_cs, stride_ch,
        stride_bt,
        stride_ot, stride_oh,
        qk_scale_log2,
        group_size, head_dim, block_size,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One program per (sequence, tile of BLOCK_M queries, query head): causal flash attention.

        Query j of a sequence with q_len new tokens and seq_len tokens in all sits at position
        ``seq_len - q_len + j``: the new tokens are the last ones. It sees keys 0..its position,
        so the walk over keys stops after the tile's last query position.
        """
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        head = tl.program_id(2)
        kv_head = head // group_size
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens_ptr + seq)
            m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = m < q_len
            q_pos = seq_len - q_len + m
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_dim
            q = tl.load(q_ptr + (q_start + m[:, None]).to(tl.int64) * stride_qt + head * stride_qh + d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)
            else:
                q = q.to(k_cache_ptr.dtype.element_ty)

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            n = tl.arange(0, BLOCK_N)
            hi = tl.minimum(seq_len, seq_len - q_len + tile * BLOCK_M + BLOCK_M)  # causal: nothing later
            for start in range(0, hi, BLOCK_N):
                pos = start + n
                valid = pos < hi
                block_id = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0)
                row = block_id.to(tl.int64) * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2
                s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if UPCAST:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            o = acc / l_i[:, None]
            tl.store(out_ptr + (q_start + m[:, None]).to(tl.int64) * stride_ot + head * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
