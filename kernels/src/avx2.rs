//! x86-64 AVX2 + FMA + F16C kernels: weight-row × activation-row dot products
//! for every block format.
//!
//! Inside a block the products are summed in integers (`maddubs`/`madd`, the
//! instruction sequences of llama.cpp's AVX2 path), across blocks in f32 FMA
//! lanes, so results equal the portable kernels' up to f32 summation order.
//!
//! Every function here needs AVX2, FMA and F16C; callers check
//! [`Isa::Avx2`](crate::isa::Isa::Avx2)`.available()` first.

use std::arch::x86_64::*;

use crate::DType;
use crate::isa::Vnni;
use crate::quant::{ActFormat, Q8_1_BLOCK_BYTES, Q8_K_BLOCK_BYTES, QK_K, q4k_scale_min};

/// f16 bits at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes at `p`; unaligned read.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 32 nibbles from 16 bytes at `p`: low nibbles in bytes 0..16, high nibbles in 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`; unaligned load.
    let t = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes at `p`; unaligned load.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Σ of unsigned × signed byte pairs, as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Dot product of one weight row of `dtype` with one activation row in
/// `ActFormat::for_weight(dtype)`; with `vnni`, the 32-value formats' byte
/// sums take the CPU's VNNI instruction (the same result).
///
/// # Safety
/// - The CPU supports AVX2, FMA and F16C (and VNNI, with `vnni`).
/// - `w.len() >= dtype.row_bytes(cols)` and
///   `x.len() >= ActFormat::for_weight(dtype).row_bytes(cols)`, with `cols`
///   a whole number of blocks of `dtype`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot(vnni: bool, dtype: DType, cols: usize, w: &[u8], x: &[u8]) -> f32 {
    debug_assert!(Some(w.len()) >= dtype.row_bytes(cols));
    debug_assert!(x.len() >= ActFormat::for_weight(dtype).row_bytes(cols));
    let (w, x) = (w.as_ptr(), x.as_ptr());
    // SAFETY: the caller guarantees the features and that both rows hold
    // every block each arm's kernel reads.
    unsafe {
        match dtype {
            DType::F32 => dot_f32(cols, w.cast(), x.cast()),
            DType::F16 => dot_f16_f16(cols, w, x),
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
                blocks32::<1>(vnni, dtype, cols / 32, w, x, 0)[0]
            }
            DType::Q4K => dot_q4k(cols / QK_K, w, x),
            DType::Q6K => dot_q6k(cols / QK_K, w, x),
        }
    }
}

/// # Safety
/// AVX2/FMA/F16C; `n` readable f32 at `a` and at `b` (any alignment).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32(n: usize, a: *const f32, b: *const f32) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads indices < n of both rows.
    unsafe {
        while i + 32 <= n {
            for (k, acc) in acc.iter_mut().enumerate() {
                let o = i + 8 * k;
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(o)), _mm256_loadu_ps(b.add(o)), *acc);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(b.add(i)), acc[0]);
            i += 8;
        }
        let mut s = hsum_f32(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        while i < n {
            s += a.add(i).read_unaligned() * b.add(i).read_unaligned();
            i += 1;
        }
        s
    }
}

/// # Safety
/// AVX2/FMA/F16C; `2n` readable bytes (n f16) at `a` and at `b`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_f16(n: usize, a: *const u8, b: *const u8) -> f32 {
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads f16 indices < n of both rows.
    unsafe {
        while i + 16 <= n {
            let a0 = _mm256_cvtph_ps(_mm_loadu_si128(a.add(2 * i).cast()));
            let b0 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * i).cast()));
            let a1 = _mm256_cvtph_ps(_mm_loadu_si128(a.add(2 * i + 16).cast()));
            let b1 = _mm256_cvtph_ps(_mm_loadu_si128(b.add(2 * i + 16).cast()));
            acc0 = _mm256_fmadd_ps(a0, b0, acc0);
            acc1 = _mm256_fmadd_ps(a1, b1, acc1);
            i += 16;
        }
        let mut s = hsum_f32(_mm256_add_ps(acc0, acc1));
        while i < n {
            s += f16_at(a.add(2 * i)) * f16_at(b.add(2 * i));
            i += 1;
        }
        s
    }
}

/// `[d_w · d_x, m_w · s_x, …]` from the first four bytes (two f16) of a
/// weight block at `wb` and of an activation block at `xb`, with one
/// conversion instruction. For blocks with a single scale only lane 0 is
/// meaningful (lane 1 multiplies quant bytes).
///
/// # Safety
/// AVX2/FMA/F16C; four readable bytes at `wb` and at `xb`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_pairs(wb: *const u8, xb: *const u8) -> __m128 {
    // SAFETY: the caller guarantees four readable bytes at each; unaligned reads.
    let (w2, x2) = unsafe {
        (
            wb.cast::<i32>().read_unaligned(),
            xb.cast::<i32>().read_unaligned(),
        )
    };
    let h = _mm_cvtph_ps(_mm_set_epi32(0, 0, x2, w2));
    _mm_mul_ps(h, _mm_movehl_ps(h, h))
}

/// The 32 weight quants of a block as bytes for `maddubs` (unsigned for
/// Q4_1, signed for Q4_0 and Q8_0).
///
/// # Safety
/// AVX2/FMA/F16C; a whole block of `dtype` is readable at `wb`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_quants(dtype: DType, wb: *const u8) -> __m256i {
    // SAFETY: the quants lie inside the block (offsets from the block layout).
    unsafe {
        match dtype {
            DType::Q4_0 => _mm256_sub_epi8(nibbles(wb.add(2)), _mm256_set1_epi8(8)),
            DType::Q4_1 => nibbles(wb.add(4)),
            _ => load32(wb.add(2)),
        }
    }
}

/// [`dot_u8_i8`]'s sums (four products per i32 lane; AVX2 takes two
/// instructions, and no i16 pair saturates for these formats: at most
/// 2 · 128 · 127) in one AVX-VNNI instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn dp_u8_i8_avxvnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
}

/// The same sums in one AVX-512 VNNI instruction on 256-bit registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn dp_u8_i8_avx512vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// Defines a 32-value-block kernel (see [`dot_blocks32`]) whose byte dot
/// products inside a block are `$dp`, compiled for `$features`.
macro_rules! blocks32_kernel {
    ($(#[$doc:meta])* $name:ident, $features:literal, $dp:ident) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        unsafe fn $name<const N: usize>(
            dtype: DType,
            nb: usize,
            w: *const u8,
            x: *const u8,
            x_stride: usize,
        ) -> [f32; N] {
            let (wbb, xbb, xq, signed) = match dtype {
                DType::Q4_0 => (18, 34, 2, true),
                DType::Q4_1 => (20, Q8_1_BLOCK_BYTES, 4, false),
                _ => (34, 34, 2, true),
            };
            let mut acc = [_mm256_setzero_ps(); N];
            // Lane 1 sums m_w · s_x (Q4_1 only).
            let mut acc_m = [_mm_setzero_ps(); N];
            for i in 0..nb {
                // SAFETY: block i of the weight row and of every activation
                // row is inside the caller's buffers.
                unsafe {
                    let wb = w.add(wbb * i);
                    let qw = weight_quants(dtype, wb);
                    // Signed weights: |w| × (x with w's sign), as llama.cpp.
                    let uw = if signed { _mm256_sign_epi8(qw, qw) } else { qw };
                    for t in 0..N {
                        let xb = x.add(t * x_stride + xbb * i);
                        let prod = scale_pairs(wb, xb);
                        let qx = load32(xb.add(xq));
                        let sx = if signed { _mm256_sign_epi8(qx, qw) } else { qx };
                        let q = $dp(uw, sx);
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_broadcastss_ps(prod),
                            _mm256_cvtepi32_ps(q),
                            acc[t],
                        );
                        if !signed {
                            acc_m[t] = _mm_add_ps(acc_m[t], prod);
                        }
                    }
                }
            }
            std::array::from_fn(|t| hsum_f32(acc[t]) + _mm_cvtss_f32(_mm_movehdup_ps(acc_m[t])))
        }
    };
}

blocks32_kernel!(
    /// Dot products of one weight row of a 32-value format (Q4_0, Q4_1,
    /// Q8_0) with `N` activation rows `x_stride` bytes apart: each block is
    /// unpacked once for the `N` tokens. Per token the arithmetic (and so
    /// the result) is the same for every `N`, so a token's output does not
    /// depend on its batch; the VNNI variants below sum the same integers.
    ///
    /// # Safety
    /// AVX2/FMA/F16C; `nb` blocks of `dtype` at `w`; `N` activation rows of
    /// `nb` blocks of `ActFormat::for_weight(dtype)` at `x + t * x_stride`.
    dot_blocks32,
    "avx2,fma,f16c",
    dot_u8_i8
);
blocks32_kernel!(
    /// [`dot_blocks32`] with AVX-VNNI.
    ///
    /// # Safety
    /// As [`dot_blocks32`], and the CPU has AVX-VNNI.
    dot_blocks32_avxvnni,
    "avx2,fma,f16c,avxvnni",
    dp_u8_i8_avxvnni
);
blocks32_kernel!(
    /// [`dot_blocks32`] with AVX-512 VNNI (and VL).
    ///
    /// # Safety
    /// As [`dot_blocks32`], and the CPU has AVX-512 F, VL and VNNI.
    dot_blocks32_avx512vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    dp_u8_i8_avx512vnni
);

/// [`dot_blocks32`] on this CPU's VNNI when `vnni`, else on AVX2 alone.
///
/// # Safety
/// As [`dot_blocks32`]; with `vnni`, [`crate::isa::vnni`] found VNNI.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn blocks32<const N: usize>(
    vnni: bool,
    dtype: DType,
    nb: usize,
    w: *const u8,
    x: *const u8,
    x_stride: usize,
) -> [f32; N] {
    // SAFETY: the caller guarantees the rows and the features; a VNNI
    // kernel runs only where `isa::vnni` detected its encoding.
    unsafe {
        match (vnni, crate::isa::vnni()) {
            (true, Some(Vnni::Avx)) => dot_blocks32_avxvnni::<N>(dtype, nb, w, x, x_stride),
            (true, Some(Vnni::Avx512)) => dot_blocks32_avx512vnni::<N>(dtype, nb, w, x, x_stride),
            _ => dot_blocks32::<N>(dtype, nb, w, x, x_stride),
        }
    }
}

/// Four dot products of one weight row with four activation rows
/// `x_stride` bytes apart, bit-identical to four [`vec_dot`] calls; `None`
/// for formats without a multi-token kernel.
///
/// # Safety
/// As [`vec_dot`] for each of the four rows at `x + t * x_stride`
/// (`x.len() >= 3 * x_stride + row bytes`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn vec_dot4(
    vnni: bool,
    dtype: DType,
    cols: usize,
    w: &[u8],
    x: &[u8],
    x_stride: usize,
) -> Option<[f32; 4]> {
    debug_assert!(x.len() >= 3 * x_stride + ActFormat::for_weight(dtype).row_bytes(cols));
    match dtype {
        DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => {
            // SAFETY: the caller guarantees the features and the four rows.
            Some(unsafe { blocks32::<4>(vnni, dtype, cols / 32, w.as_ptr(), x.as_ptr(), x_stride) })
        }
        _ => None,
    }
}

/// The 16 `bsums` of a Q8_K block at `xb`.
///
/// # Safety
/// A whole Q8_K block is readable at `xb`.
#[inline]
unsafe fn q8k_bsums(xb: *const u8) -> [i32; 16] {
    let mut b = [0i32; 16];
    for (g, v) in b.iter_mut().enumerate() {
        // SAFETY: bsums occupy bytes 260..292 of the block.
        *v = i32::from(unsafe { xb.add(4 + QK_K + 2 * g).cast::<i16>().read_unaligned() });
    }
    b
}

/// # Safety
/// AVX2/FMA/F16C; `nb` Q4_K blocks at `w`, `nb` Q8_K blocks at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4k(nb: usize, w: *const u8, x: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = 0.0f32;
    let low = _mm256_set1_epi8(0x0F);
    for i in 0..nb {
        // SAFETY: block i lies inside both rows.
        unsafe {
            let (wb, xb) = (w.add(144 * i), x.add(Q8_K_BLOCK_BYTES * i));
            let dy = xb.cast::<f32>().read_unaligned();
            let d = dy * f16_at(wb);
            let dmin = dy * f16_at(wb.add(2));
            let scales = std::slice::from_raw_parts(wb.add(4), 12);
            let bsums = q8k_bsums(xb);
            let mut summ = 0i32;
            let mut sumi = _mm256_setzero_si256();
            for c in 0..4 {
                let (s1, m1) = q4k_scale_min(2 * c, scales);
                let (s2, m2) = q4k_scale_min(2 * c + 1, scales);
                summ += i32::from(m1) * (bsums[4 * c] + bsums[4 * c + 1]);
                summ += i32::from(m2) * (bsums[4 * c + 2] + bsums[4 * c + 3]);
                let q4 = load32(wb.add(16 + 32 * c));
                let lo = _mm256_and_si256(q4, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), low);
                let pl = _mm256_maddubs_epi16(lo, load32(xb.add(4 + 64 * c)));
                let ph = _mm256_maddubs_epi16(hi, load32(xb.add(4 + 64 * c + 32)));
                let pl = _mm256_madd_epi16(pl, _mm256_set1_epi16(i16::from(s1)));
                let ph = _mm256_madd_epi16(ph, _mm256_set1_epi16(i16::from(s2)));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            acc_m += dmin * summ as f32;
        }
    }
    hsum_f32(acc) - acc_m
}

/// # Safety
/// AVX2/FMA/F16C; `nb` Q6_K blocks at `w`, `nb` Q8_K blocks at `x`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6k(nb: usize, w: *const u8, x: *const u8) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut acc_bias = 0.0f32;
    let low = _mm256_set1_epi8(0x0F);
    let three = _mm256_set1_epi8(3);
    for i in 0..nb {
        // SAFETY: block i lies inside both rows.
        unsafe {
            let (wb, xb) = (w.add(210 * i), x.add(Q8_K_BLOCK_BYTES * i));
            let d = f16_at(wb.add(208)) * xb.cast::<f32>().read_unaligned();
            let sc: [i16; 16] = std::array::from_fn(|g| i16::from(*wb.add(192 + g) as i8));
            let bsums = q8k_bsums(xb);
            let bias: i32 = (0..16).map(|g| i32::from(sc[g]) * bsums[g]).sum();
            let mut sumi = _mm256_setzero_si256();
            for half in 0..2 {
                let ql0 = load32(wb.add(64 * half));
                let ql1 = load32(wb.add(64 * half + 32));
                let qh = load32(wb.add(128 + 32 * half));
                let h0 = _mm256_slli_epi16(_mm256_and_si256(qh, three), 4);
                let h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4);
                let h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), three), 4);
                let h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), three), 4);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low), h0),
                    _mm256_or_si256(_mm256_and_si256(ql1, low), h1),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), h2),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), h3),
                ];
                for (k, qk) in q.iter().enumerate() {
                    let g = 8 * half + 2 * k;
                    let p = _mm256_maddubs_epi16(*qk, load32(xb.add(4 + 128 * half + 32 * k)));
                    let s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
                }
            }
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            acc_bias += d * (32 * bias) as f32;
        }
    }
    hsum_f32(acc) - acc_bias
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    /// Blocks of `bytes` bytes: an f16 scale (and, for 36-byte activation
    /// blocks, a second) of 0.5, then pseudo-random quants.
    fn blocks(n: usize, bytes: usize, quants_at: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        let half = half::f16::from_f32(0.5).to_bits().to_le_bytes();
        let mut out = Vec::with_capacity(n * bytes);
        for _ in 0..n {
            let start = out.len();
            for o in 0..bytes {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                out.push(if o < quants_at {
                    half[o % 2]
                } else {
                    (x >> 56) as u8
                });
            }
            debug_assert_eq!(out.len() - start, bytes);
        }
        out
    }

    #[test]
    fn every_vnni_encoding_sums_what_avx2_sums() {
        if !Isa::Avx2.available() {
            return;
        }
        let nb = 24;
        for (dtype, wbb, wq, xbb, xq) in [
            (DType::Q4_0, 18, 2, 34, 2),
            (DType::Q4_1, 20, 4, Q8_1_BLOCK_BYTES, 4),
            (DType::Q8_0, 34, 2, 34, 2),
        ] {
            let w = blocks(nb, wbb, wq, 1);
            let x = blocks(4 * nb, xbb, xq, 2);
            let stride = nb * xbb;
            // SAFETY: AVX2 is present; the rows hold nb blocks each, four
            // activation rows `stride` apart; each VNNI kernel runs only
            // where the CPU has its encoding.
            unsafe {
                let want = dot_blocks32::<4>(dtype, nb, w.as_ptr(), x.as_ptr(), stride);
                let mut got = Vec::new();
                if is_x86_feature_detected!("avxvnni") {
                    got.push(dot_blocks32_avxvnni::<4>(
                        dtype,
                        nb,
                        w.as_ptr(),
                        x.as_ptr(),
                        stride,
                    ));
                }
                if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
                    got.push(dot_blocks32_avx512vnni::<4>(
                        dtype,
                        nb,
                        w.as_ptr(),
                        x.as_ptr(),
                        stride,
                    ));
                }
                for g in got {
                    assert_eq!(g.map(f32::to_bits), want.map(f32::to_bits), "{dtype}");
                }
            }
        }
    }
}
