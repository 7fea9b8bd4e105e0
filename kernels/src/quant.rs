//! Block formats: dequantizing weight rows of every [`DType`], quantizing
//! activations the way llama.cpp's CPU backend does before a dot product, and
//! the portable (scalar) dot products of a weight row with a quantized
//! activation row.
//!
//! All blocks are handled as little-endian bytes in GGML layout:
//!
//! ```text
//!  Q4_0  (18 B / 32)  | d: f16 | qs: 16 B, value j in low nibble of qs[j], j+16 in high |  x = d * (q - 8)
//!  Q4_1  (20 B / 32)  | d: f16 | m: f16 | qs: 16 B (as Q4_0)                            |  x = d * q + m
//!  Q8_0  (34 B / 32)  | d: f16 | qs: 32 × i8 |                                             x = d * q
//!  Q8_1  (36 B / 32)  | d: f16 | s: f16 = d * Σq | qs: 32 × i8 |    (activations only)
//!  Q4_K (144 B / 256) | d: f16 | dmin: f16 | scales: 12 B (8 × 6-bit scale, 8 × 6-bit min) | qs: 128 B |
//!                       chunk c of 64 values: low nibbles of qs[32c..32c+32] are values 64c..64c+32
//!                       (scale/min 2c), high nibbles the next 32 (scale/min 2c+1);  x = d*sc*q - dmin*m
//!  Q6_K (210 B / 256) | ql: 128 B | qh: 64 B | scales: 16 × i8 | d: f16 |  x = d * scales[k/16] * (q - 32)
//!  Q8_K (292 B / 256) | d: f32 | qs: 256 × i8 | bsums: 16 × i16 (sums of 16 qs) |   (activations only)
//! ```
//!
//! Which activation format goes with which weight type ([`ActFormat::for_weight`])
//! is llama.cpp's `vec_dot_type`: Q4_0 and Q8_0 with Q8_0, Q4_1 with Q8_1,
//! the K-quants with Q8_K, F16 with F16, F32 with F32.

use half::f16;

use crate::DType;
use crate::error::KernelError;

/// Values per block of the 32-value formats.
pub const QK: usize = 32;
/// Values per super-block of the K-quant formats.
pub const QK_K: usize = 256;

/// Bytes of a Q8_1 block.
pub const Q8_1_BLOCK_BYTES: usize = 36;
/// Bytes of a Q8_K block.
pub const Q8_K_BLOCK_BYTES: usize = 292;

/// The format activations are converted to before a dot product with a
/// weight row (llama.cpp's `vec_dot_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// Plain f32 (for F32 weights).
    F32,
    /// IEEE half (for F16 weights).
    F16,
    /// 32-value blocks, f16 scale (for Q4_0 and Q8_0 weights).
    Q8_0,
    /// 32-value blocks, f16 scale and f16 scaled sum (for Q4_1 weights).
    Q8_1,
    /// 256-value blocks, f32 scale and 16 partial sums (for K-quant weights).
    Q8K,
}

impl ActFormat {
    /// The activation format llama.cpp pairs with weights of type `dtype`.
    #[must_use]
    pub const fn for_weight(dtype: DType) -> ActFormat {
        match dtype {
            DType::F32 => ActFormat::F32,
            DType::F16 => ActFormat::F16,
            DType::Q4_0 | DType::Q8_0 => ActFormat::Q8_0,
            DType::Q4_1 => ActFormat::Q8_1,
            DType::Q4K | DType::Q6K => ActFormat::Q8K,
        }
    }

    /// Bytes of one quantized row of `cols` values (`cols` must be a whole
    /// number of blocks, which the weight type already guarantees).
    #[must_use]
    pub const fn row_bytes(self, cols: usize) -> usize {
        match self {
            ActFormat::F32 => cols * 4,
            ActFormat::F16 => cols * 2,
            ActFormat::Q8_0 => cols / QK * 34,
            ActFormat::Q8_1 => cols / QK * Q8_1_BLOCK_BYTES,
            ActFormat::Q8K => cols / QK_K * Q8_K_BLOCK_BYTES,
        }
    }
}

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

#[inline(always)]
pub(crate) fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// llama.cpp's `nearest_int`: round half to even. Within ±2^22 − 1 (every
/// quantizer's range) it is llama.cpp's own arithmetic: adding 1.5 · 2^23
/// leaves the rounded integer in the mantissa. That avoids
/// `round_ties_even`, which without SSE4.1 in the baseline target is a call
/// to libm's `rintf` per element (a tenth of a decode step's time). Outside
/// that range, and for NaN, `round_ties_even` decides.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    if v.abs() <= 4_194_303.0 {
        let bits = (v + 12_582_912.0).to_bits() as i32;
        (bits & 0x007f_ffff) - 0x0040_0000
    } else {
        v.round_ties_even() as i32
    }
}

/// Checks that `cols` is a whole number of blocks of `dtype`.
///
/// # Errors
/// [`KernelError::ColsNotWholeBlocks`] otherwise.
pub fn check_cols(dtype: DType, cols: usize) -> Result<usize, KernelError> {
    dtype
        .row_bytes(cols)
        .ok_or(KernelError::ColsNotWholeBlocks {
            dtype,
            cols,
            block_elems: dtype.block_elems(),
        })
}

// ---------------------------------------------------------------------------
// Activation quantization (identical on every CPU path).
// ---------------------------------------------------------------------------

/// Quantizes `x` into Q8_0 blocks as llama.cpp's x86 path does:
/// `q = round_half_even(x * 127 / amax)`, `d = f16(amax / 127)`.
///
/// # Panics
/// If `x.len()` is not a multiple of 32 or `out` is not
/// `x.len() / 32 * 34` bytes.
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    quantize_q8_blocks(x, out, 34, false);
}

/// Quantizes `x` into Q8_1 blocks (Q8_0 plus `s = f16(d * Σq)`).
///
/// # Panics
/// If `x.len()` is not a multiple of 32 or `out` is not `x.len() / 32 * 36` bytes.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    quantize_q8_blocks(x, out, Q8_1_BLOCK_BYTES, true);
}

fn quantize_q8_blocks(x: &[f32], out: &mut [u8], block_bytes: usize, with_sum: bool) {
    assert_eq!(
        x.len() % QK,
        0,
        "activation length {} is not a multiple of 32",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / QK * block_bytes,
        "quantized activation buffer size"
    );
    let qoff = if with_sum { 4 } else { 2 };
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(block_bytes)) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (o, &v) in ob[qoff..].iter_mut().zip(xb) {
            let q = nearest_int(v * id);
            sum += q;
            *o = q as i8 as u8;
        }
        put_f16(ob, 0, d);
        if with_sum {
            put_f16(ob, 2, d * sum as f32);
        }
    }
}

/// Quantizes `x` into Q8_K blocks as llama.cpp's `quantize_row_q8_K_ref`:
/// `iscale = -127 / max` (max = the value of largest magnitude),
/// `q = min(127, round_half_even(iscale * x))`, `d = 1 / iscale`.
///
/// # Panics
/// If `x.len()` is not a multiple of 256 or `out` is not `x.len() / 256 * 292` bytes.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [u8]) {
    assert_eq!(
        x.len() % QK_K,
        0,
        "activation length {} is not a multiple of 256",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / QK_K * Q8_K_BLOCK_BYTES,
        "quantized activation buffer size"
    );
    for (xb, ob) in x
        .chunks_exact(QK_K)
        .zip(out.chunks_exact_mut(Q8_K_BLOCK_BYTES))
    {
        let (mut max, mut amax) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            ob.fill(0);
            continue;
        }
        let iscale = -127.0 / max;
        let qs = &mut ob[4..4 + QK_K];
        for (o, &v) in qs.iter_mut().zip(xb) {
            *o = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        let mut bsums = [0i16; 16];
        for (g, s) in bsums.iter_mut().enumerate() {
            *s = qs[16 * g..16 * g + 16]
                .iter()
                .map(|&q| i16::from(q as i8))
                .sum();
        }
        ob[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        for (g, s) in bsums.iter().enumerate() {
            ob[4 + QK_K + 2 * g..4 + QK_K + 2 * g + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// Converts one activation row into `fmt` (`out` sized by [`ActFormat::row_bytes`]).
///
/// # Panics
/// If the lengths do not match the format.
pub fn quantize_activations(fmt: ActFormat, x: &[f32], out: &mut [u8]) {
    match fmt {
        ActFormat::F32 => {
            assert_eq!(out.len(), x.len() * 4, "f32 activation buffer size");
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActFormat::F16 => {
            assert_eq!(out.len(), x.len() * 2, "f16 activation buffer size");
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        ActFormat::Q8_0 => quantize_row_q8_0(x, out),
        ActFormat::Q8_1 => quantize_row_q8_1(x, out),
        ActFormat::Q8K => quantize_row_q8_k(x, out),
    }
}

// ---------------------------------------------------------------------------
// Dequantization.
// ---------------------------------------------------------------------------

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block.
#[inline(always)]
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 6-bit value `k` (0..256) of a Q6_K block, before subtracting 32.
#[inline(always)]
fn q6k_value(b: &[u8], k: usize) -> u8 {
    let (half, e) = (k / 128, k % 128);
    let (quarter, l) = (e / 32, e % 32);
    let ql = &b[64 * half..];
    let qh = b[128 + 32 * half + l];
    let low = match quarter {
        0 => ql[l] & 0xF,
        1 => ql[l + 32] & 0xF,
        2 => ql[l] >> 4,
        _ => ql[l + 32] >> 4,
    };
    low | (((qh >> (2 * quarter)) & 3) << 4)
}

/// Dequantizes one row (`data` = exactly one row of `out.len()` values of `dtype`).
///
/// # Panics
/// If `out.len()` is not a whole number of blocks or `data` is not one row of it.
pub fn dequantize_row(dtype: DType, data: &[u8], out: &mut [f32]) {
    let n = out.len();
    let bytes = dtype
        .row_bytes(n)
        .unwrap_or_else(|| panic!("{dtype} row of {n} values is not a whole number of blocks"));
    assert_eq!(
        data.len(),
        bytes,
        "{dtype} row of {n} values needs {bytes} bytes"
    );
    let be = dtype.block_elems();
    let bb = dtype.block_bytes();
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32_at(b, 0);
            }
        }
        DType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16_at(b, 0);
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let (qoff, has_min) = if dtype == DType::Q4_1 {
                (4, true)
            } else {
                (2, false)
            };
            for (o, b) in out.chunks_exact_mut(be).zip(data.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let m = if has_min { f16_at(b, 2) } else { 0.0 };
                for j in 0..16 {
                    let (lo, hi) = (b[qoff + j] & 0xF, b[qoff + j] >> 4);
                    if has_min {
                        o[j] = f32::from(lo) * d + m;
                        o[j + 16] = f32::from(hi) * d + m;
                    } else {
                        o[j] = (i32::from(lo) - 8) as f32 * d;
                        o[j + 16] = (i32::from(hi) - 8) as f32 * d;
                    }
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(be).zip(data.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                for (v, &q) in o.iter_mut().zip(&b[2..34]) {
                    *v = f32::from(q as i8) * d;
                }
            }
        }
        DType::Q4K => {
            for (o, b) in out.chunks_exact_mut(be).zip(data.chunks_exact(bb)) {
                let d = f16_at(b, 0);
                let dmin = f16_at(b, 2);
                let scales = &b[4..16];
                let qs = &b[16..144];
                for c in 0..4 {
                    let (s1, m1) = q4k_scale_min(2 * c, scales);
                    let (s2, m2) = q4k_scale_min(2 * c + 1, scales);
                    let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
                    let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        o[64 * c + l] = d1 * f32::from(q & 0xF) - m1;
                        o[64 * c + 32 + l] = d2 * f32::from(q >> 4) - m2;
                    }
                }
            }
        }
        DType::Q6K => {
            for (o, b) in out.chunks_exact_mut(be).zip(data.chunks_exact(bb)) {
                let d = f16_at(b, 208);
                for (k, v) in o.iter_mut().enumerate() {
                    let sc = f32::from(b[192 + k / 16] as i8);
                    *v = d * sc * (i32::from(q6k_value(b, k)) - 32) as f32;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Weight quantizers (to build test matrices and synthetic models).
// ---------------------------------------------------------------------------

/// Quantizes one row of f32 weights into `dtype` (`out` = one row of
/// `x.len()` values). Q4_0, Q4_1 and Q8_0 follow llama.cpp's reference
/// quantizers exactly; Q4_K and Q6_K use a simple min/max (not llama.cpp's
/// error-minimising search), which gives valid blocks of somewhat lower
/// quality.
///
/// # Errors
/// [`KernelError::ColsNotWholeBlocks`] if `x.len()` is not a whole number of blocks.
///
/// # Panics
/// If `out` is not exactly one row long.
pub fn quantize_row(dtype: DType, x: &[f32], out: &mut [u8]) -> Result<(), KernelError> {
    let bytes = check_cols(dtype, x.len())?;
    assert_eq!(
        out.len(),
        bytes,
        "{dtype} row of {} values needs {bytes} bytes",
        x.len()
    );
    let be = dtype.block_elems();
    let bb = dtype.block_bytes();
    let blocks = x.chunks_exact(be).zip(out.chunks_exact_mut(bb));
    match dtype {
        DType::F32 => quantize_activations(ActFormat::F32, x, out),
        DType::F16 => quantize_activations(ActFormat::F16, x, out),
        DType::Q4_0 => {
            for (xb, ob) in blocks {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in xb {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(ob, 0, d);
                for j in 0..16 {
                    let q0 = ((xb[j] * id + 8.5) as i8).min(15) as u8;
                    let q1 = ((xb[j + 16] * id + 8.5) as i8).min(15) as u8;
                    ob[2 + j] = q0 | (q1 << 4);
                }
            }
        }
        DType::Q4_1 => {
            for (xb, ob) in blocks {
                let min = xb.iter().fold(f32::MAX, |m, &v| m.min(v));
                let max = xb.iter().fold(-f32::MAX, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(ob, 0, d);
                put_f16(ob, 2, min);
                for j in 0..16 {
                    let q0 = (((xb[j] - min) * id + 0.5) as i8).min(15) as u8;
                    let q1 = (((xb[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
                    ob[4 + j] = q0 | (q1 << 4);
                }
            }
        }
        DType::Q8_0 => {
            for (xb, ob) in blocks {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                put_f16(ob, 0, d);
                for (o, &v) in ob[2..].iter_mut().zip(xb) {
                    *o = (v * id).round() as i8 as u8;
                }
            }
        }
        DType::Q4K => {
            for (xb, ob) in blocks {
                quantize_block_q4k(xb, ob);
            }
        }
        DType::Q6K => {
            for (xb, ob) in blocks {
                quantize_block_q6k(xb, ob);
            }
        }
    }
    Ok(())
}

fn quantize_block_q4k(x: &[f32], ob: &mut [u8]) {
    // Per 32-value sub-block: x ≈ scale * q - min, q in 0..=15, min >= 0.
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for j in 0..8 {
        let s = &x[32 * j..32 * j + 32];
        let lo = s.iter().fold(f32::MAX, |m, &v| m.min(v)).min(0.0);
        let hi = s.iter().fold(-f32::MAX, |m, &v| m.max(v));
        scales[j] = (hi - lo) / 15.0;
        mins[j] = -lo;
    }
    let max_scale = scales.iter().fold(0.0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = f16::from_f32(max_scale / 63.0).to_f32();
    let dmin = f16::from_f32(max_min / 63.0).to_f32();
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = if d > 0.0 {
            nearest_int(scales[j] / d).clamp(0, 63) as u8
        } else {
            0
        };
        lm[j] = if dmin > 0.0 {
            nearest_int(mins[j] / dmin).clamp(0, 63) as u8
        } else {
            0
        };
    }
    put_f16(ob, 0, d);
    put_f16(ob, 2, dmin);
    let sc = &mut ob[4..16];
    for j in 0..8 {
        if j < 4 {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (ls[j] & 0xF) | ((lm[j] & 0xF) << 4);
            sc[j - 4] |= (ls[j] >> 4) << 6;
            sc[j] |= (lm[j] >> 4) << 6;
        }
    }
    let mut q = [0u8; 256];
    for j in 0..8 {
        let (s, m) = q4k_scale_min(j, &ob[4..16]);
        let ds = d * f32::from(s);
        let dm = dmin * f32::from(m);
        for l in 0..32 {
            let v = x[32 * j + l];
            q[32 * j + l] = if ds > 0.0 {
                nearest_int((v + dm) / ds).clamp(0, 15) as u8
            } else {
                0
            };
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            ob[16 + 32 * c + l] = q[64 * c + l] | (q[64 * c + 32 + l] << 4);
        }
    }
}

fn quantize_block_q6k(x: &[f32], ob: &mut [u8]) {
    // Per 16-value group: x ≈ d * sc * (q - 32), sc an i8, q - 32 in -32..=31.
    let mut gscale = [0.0f32; 16];
    for (g, s) in gscale.iter_mut().enumerate() {
        *s = x[16 * g..16 * g + 16]
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            / 31.0;
    }
    let max_scale = gscale.iter().fold(0.0f32, |m, &v| m.max(v));
    let d = f16::from_f32(max_scale / 127.0).to_f32();
    ob.fill(0);
    put_f16(ob, 208, d);
    let mut sc = [0i8; 16];
    for g in 0..16 {
        sc[g] = if d > 0.0 {
            nearest_int(gscale[g] / d).clamp(-128, 127) as i8
        } else {
            0
        };
        ob[192 + g] = sc[g] as u8;
    }
    for (k, &v) in x.iter().enumerate() {
        let ds = d * f32::from(sc[k / 16]);
        let q = if ds != 0.0 {
            nearest_int(v / ds).clamp(-32, 31)
        } else {
            0
        };
        let q = (q + 32) as u8;
        let (half, e) = (k / 128, k % 128);
        let (quarter, l) = (e / 32, e % 32);
        let ql = &mut ob[64 * half..64 * half + 64];
        match quarter {
            0 => ql[l] |= q & 0xF,
            1 => ql[l + 32] |= q & 0xF,
            2 => ql[l] |= (q & 0xF) << 4,
            _ => ql[l + 32] |= (q & 0xF) << 4,
        }
        ob[128 + 32 * half + l] |= (q >> 4) << (2 * quarter);
    }
}

// ---------------------------------------------------------------------------
// Portable dot products: weight row × activation row in its ActFormat.
// ---------------------------------------------------------------------------

/// Dot product of one weight row of `cols` values with one activation row
/// already converted to `ActFormat::for_weight(dtype)`; portable code, integer
/// sums inside a block, f32 accumulation across blocks (llama.cpp's generic
/// kernels).
///
/// # Panics
/// If the row lengths do not match `cols`.
#[must_use]
pub fn vec_dot_portable(dtype: DType, cols: usize, w: &[u8], x: &[u8]) -> f32 {
    assert_eq!(
        Some(w.len()),
        dtype.row_bytes(cols),
        "{dtype} weight row of {cols} values"
    );
    assert_eq!(
        x.len(),
        ActFormat::for_weight(dtype).row_bytes(cols),
        "activation row of {cols}"
    );
    match dtype {
        DType::F32 => w
            .chunks_exact(4)
            .zip(x.chunks_exact(4))
            .map(|(a, b)| f64::from(f32_at(a, 0)) * f64::from(f32_at(b, 0)))
            .sum::<f64>() as f32,
        DType::F16 => w
            .chunks_exact(2)
            .zip(x.chunks_exact(2))
            .map(|(a, b)| f64::from(f16_at(a, 0)) * f64::from(f16_at(b, 0)))
            .sum::<f64>() as f32,
        DType::Q4_0 => {
            let mut sumf = 0.0f32;
            for (wb, xb) in w.chunks_exact(18).zip(x.chunks_exact(34)) {
                let mut sumi = 0i32;
                for j in 0..16 {
                    let lo = i32::from(wb[2 + j] & 0xF) - 8;
                    let hi = i32::from(wb[2 + j] >> 4) - 8;
                    sumi += lo * i32::from(xb[2 + j] as i8) + hi * i32::from(xb[18 + j] as i8);
                }
                sumf += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
            }
            sumf
        }
        DType::Q4_1 => {
            let mut sumf = 0.0f32;
            for (wb, xb) in w.chunks_exact(20).zip(x.chunks_exact(Q8_1_BLOCK_BYTES)) {
                let mut sumi = 0i32;
                for j in 0..16 {
                    let lo = i32::from(wb[4 + j] & 0xF);
                    let hi = i32::from(wb[4 + j] >> 4);
                    sumi += lo * i32::from(xb[4 + j] as i8) + hi * i32::from(xb[20 + j] as i8);
                }
                sumf +=
                    (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32 + f16_at(wb, 2) * f16_at(xb, 2);
            }
            sumf
        }
        DType::Q8_0 => {
            let mut sumf = 0.0f32;
            for (wb, xb) in w.chunks_exact(34).zip(x.chunks_exact(34)) {
                let sumi: i32 = wb[2..]
                    .iter()
                    .zip(&xb[2..])
                    .map(|(&a, &b)| i32::from(a as i8) * i32::from(b as i8))
                    .sum();
                sumf += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
            }
            sumf
        }
        DType::Q4K => {
            let mut sumf = 0.0f32;
            for (wb, xb) in w.chunks_exact(144).zip(x.chunks_exact(Q8_K_BLOCK_BYTES)) {
                let dy = f32_at(xb, 0);
                let q8 = &xb[4..4 + QK_K];
                let bsum =
                    |g: usize| i32::from(i16::from_le_bytes([xb[260 + 2 * g], xb[261 + 2 * g]]));
                let scales = &wb[4..16];
                let qs = &wb[16..144];
                let (mut sumi, mut summ) = (0i32, 0i32);
                for j in 0..8 {
                    let (s, m) = q4k_scale_min(j, scales);
                    summ += i32::from(m) * (bsum(2 * j) + bsum(2 * j + 1));
                    let (c, shift) = (j / 2, 4 * (j % 2));
                    let mut dot = 0i32;
                    for l in 0..32 {
                        let q = i32::from((qs[32 * c + l] >> shift) & 0xF);
                        dot += q * i32::from(q8[32 * j + l] as i8);
                    }
                    sumi += i32::from(s) * dot;
                }
                sumf += dy * f16_at(wb, 0) * sumi as f32 - dy * f16_at(wb, 2) * summ as f32;
            }
            sumf
        }
        DType::Q6K => {
            let mut sumf = 0.0f32;
            for (wb, xb) in w.chunks_exact(210).zip(x.chunks_exact(Q8_K_BLOCK_BYTES)) {
                let q8 = &xb[4..4 + QK_K];
                let mut sumi = 0i32;
                for g in 0..16 {
                    let dot: i32 = (16 * g..16 * g + 16)
                        .zip(&q8[16 * g..16 * g + 16])
                        .map(|(k, &y)| (i32::from(q6k_value(wb, k)) - 32) * i32::from(y as i8))
                        .sum();
                    sumi += i32::from(wb[192 + g] as i8) * dot;
                }
                sumf += f16_at(wb, 208) * f32_at(xb, 0) * sumi as f32;
            }
            sumf
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mantissa trick rounds exactly as `round_ties_even` on every
    /// value a quantizer can give it: halves go to even, both signs, up to
    /// the edge of its range, and beyond it and for NaN the fallback.
    #[test]
    fn nearest_int_rounds_half_to_even_like_round_ties_even() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            126.5,
            -127.5,
            127.49999,
            4_194_303.0,
            -4_194_303.0,
            4_194_302.5,
            4_194_304.0,
            -8.0e6,
            1.0e9,
            f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ];
        values.extend((0..100_000).map(|_| rng.random_range(-130.0f32..130.0)));
        values.extend((-300..300).map(|i| i as f32 * 0.5));
        for v in values {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn q8_1_sum_is_scale_times_sum_of_quants() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 10.0) * 0.37).collect();
        let mut out = vec![0u8; 36];
        quantize_row_q8_1(&x, &mut out);
        let d = f16_at(&out, 0);
        let sum: i32 = out[4..].iter().map(|&q| i32::from(q as i8)).sum();
        assert!((f16_at(&out, 2) - d * sum as f32).abs() <= 1e-3 * (d * sum as f32).abs());
        let amax_q = out[4..].iter().map(|&q| (q as i8).unsigned_abs()).max();
        assert_eq!(amax_q, Some(127));
    }

    #[test]
    fn q8_k_bsums_are_group_sums_and_dequantize_close() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut out = vec![0u8; Q8_K_BLOCK_BYTES];
        quantize_row_q8_k(&x, &mut out);
        let d = f32_at(&out, 0);
        for g in 0..16 {
            let s: i32 = out[4 + 16 * g..4 + 16 * g + 16]
                .iter()
                .map(|&q| i32::from(q as i8))
                .sum();
            assert_eq!(
                i32::from(i16::from_le_bytes([out[260 + 2 * g], out[261 + 2 * g]])),
                s
            );
        }
        for (k, &v) in x.iter().enumerate() {
            assert!((f32::from(out[4 + k] as i8) * d - v).abs() <= d.abs() * 0.5 + 1e-6);
        }
    }

    #[test]
    fn weight_quantizers_round_trip_within_one_step() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 3.0)
            .collect();
        for (dtype, tol) in [
            (DType::F16, 2e-3),
            (DType::Q8_0, 0.02),
            (DType::Q4_0, 0.25),
            (DType::Q4_1, 0.12),
            (DType::Q4K, 0.2),
            (DType::Q6K, 0.06),
        ] {
            let mut q = vec![0u8; dtype.row_bytes(x.len()).unwrap()];
            quantize_row(dtype, &x, &mut q).unwrap();
            let mut back = vec![0.0; x.len()];
            dequantize_row(dtype, &q, &mut back);
            let worst = x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(
                worst <= tol,
                "{dtype}: worst round-trip error {worst} > {tol}"
            );
        }
    }

    #[test]
    fn quantize_row_rejects_partial_blocks() {
        let err = quantize_row(DType::Q4K, &[0.0; 576], &mut []).unwrap_err();
        assert_eq!(
            err,
            KernelError::ColsNotWholeBlocks {
                dtype: DType::Q4K,
                cols: 576,
                block_elems: 256
            }
        );
    }
}
