//! Weight-matrix × activation products, quantized like llama.cpp's CPU path.
//!
//! ```text
//!  x: n_tokens × cols (f32) ──quantize once──▶ xq: n_tokens rows in ActFormat::for_weight(dtype)
//!
//!  W: rows × cols (GGML blocks)           y: n_tokens × rows (f32)
//!  ┌──────────────┐ task 0 ─┐             y[t*rows + r] = dot(W[r], xq[t])
//!  │ rows 0..R    │         │ for each tile of 8 tokens:
//!  ├──────────────┤ task 1  │   for each row r of the task:   (weight row stays in L1
//!  │ rows R..2R   │         │     for each token t of tile:    across the tile's tokens)
//!  └──────────────┘ …       ┘       y[t][r] = dot(W[r], xq[t])
//! ```

use std::cell::RefCell;

use crate::DType;
use crate::Exec;
use crate::error::KernelError;
use crate::isa::Isa;
use crate::quant::{self, ActFormat};
use crate::threads::SharedMut;

/// A row-major weight matrix in GGML layout: `rows` rows of `cols` values,
/// each row `dtype.row_bytes(cols)` bytes.
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    /// Element type of the rows.
    pub dtype: DType,
    /// Number of rows (outputs).
    pub rows: usize,
    /// Values per row (inputs).
    pub cols: usize,
    /// `rows × dtype.row_bytes(cols)` bytes.
    pub data: &'a [u8],
}

impl<'a> WeightMatrix<'a> {
    /// A matrix over `data`, checked against its geometry.
    ///
    /// # Errors
    /// [`KernelError::ColsNotWholeBlocks`] if `cols` is not a whole number of
    /// blocks of `dtype`; [`KernelError::WeightSize`] if `data` is not exactly
    /// `rows × row_bytes(cols)` bytes.
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        let row_bytes = quant::check_cols(dtype, cols)?;
        let expected = rows.saturating_mul(row_bytes);
        if data.len() != expected {
            return Err(KernelError::WeightSize {
                dtype,
                rows,
                cols,
                expected,
                actual: data.len(),
            });
        }
        Ok(WeightMatrix {
            dtype,
            rows,
            cols,
            data,
        })
    }

    /// Bytes of one row.
    #[must_use]
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The bytes of row `r`.
    ///
    /// # Panics
    /// If `r >= rows`.
    #[must_use]
    pub fn row(&self, r: usize) -> &'a [u8] {
        assert!(r < self.rows, "row {r} of a matrix with {} rows", self.rows);
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows and data consistent (a matrix built field by field may not be).
    fn assert_consistent(&self) {
        let rb = self.dtype.row_bytes(self.cols);
        assert!(
            rb.is_some_and(|rb| rb * self.rows == self.data.len()),
            "{} weight matrix {}x{} with {} bytes of data: build it with WeightMatrix::new",
            self.dtype,
            self.rows,
            self.cols,
            self.data.len()
        );
    }
}

/// Dequantizes row `row` of `w` into `out` (`w.cols` values); also the embedding lookup.
///
/// # Panics
/// If `row >= w.rows` or `out.len() != w.cols`.
pub fn dequantize_row(w: &WeightMatrix, row: usize, out: &mut [f32]) {
    assert_eq!(
        out.len(),
        w.cols,
        "output of {} values for rows of {}",
        out.len(),
        w.cols
    );
    quant::dequantize_row(w.dtype, w.row(row), out);
}

/// `y[t*rows + r] = Σ_c W[r][c] * x[t*cols + c]` for `t` in `0..n_tokens`, on
/// the global pool with the detected instruction set. `x` is quantized to
/// llama.cpp's `vec_dot_type` of `w.dtype` first.
///
/// # Panics
/// If `x.len() != n_tokens * w.cols` or `y.len() != n_tokens * w.rows`.
pub fn matmul(w: &WeightMatrix, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    matmul_with(Exec::global(), w, x, n_tokens, y);
}

thread_local! {
    static XQ_SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Tokens per tile: a weight row is reused across this many tokens while in L1.
const TOKEN_TILE: usize = 8;

/// [`matmul`] on a given pool and instruction set (an unavailable ISA falls
/// back to [`Isa::Portable`]).
///
/// # Panics
/// As [`matmul`].
pub fn matmul_with(exec: Exec, w: &WeightMatrix, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    w.assert_consistent();
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(
        x.len(),
        n_tokens * cols,
        "x of {} values for {n_tokens} tokens of {cols}",
        x.len()
    );
    assert_eq!(
        y.len(),
        n_tokens * rows,
        "y of {} values for {n_tokens} tokens of {rows}",
        y.len()
    );
    if n_tokens == 0 || rows == 0 {
        return;
    }
    let (pool, isa) = (exec.pool, exec.isa.or_portable());
    let fmt = ActFormat::for_weight(w.dtype);
    let xrb = fmt.row_bytes(cols);

    let mut xq = XQ_SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    xq.resize(n_tokens * xrb, 0);
    if n_tokens >= 4 * pool.threads() && n_tokens >= 16 {
        let xq_out = SharedMut::new(&mut xq);
        let chunk = n_tokens.div_ceil(pool.threads() * 4);
        pool.run(n_tokens.div_ceil(chunk), |task| {
            let t0 = task * chunk;
            let t1 = (t0 + chunk).min(n_tokens);
            // SAFETY: task `task` alone writes the quantized rows t0..t1.
            let out = unsafe { xq_out.slice(t0 * xrb, (t1 - t0) * xrb) };
            for (t, o) in (t0..t1).zip(out.chunks_exact_mut(xrb)) {
                quant::quantize_activations(fmt, &x[t * cols..(t + 1) * cols], o);
            }
        });
    } else {
        for (xr, o) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(xrb)) {
            quant::quantize_activations(fmt, xr, o);
        }
    }

    // Tasks over row chunks of ~64K multiply-adds (a few µs): small enough
    // that a worker descheduled while holding one (a shared core) delays the
    // caller little, and at least four per thread to balance the load.
    let rows_for_work = (1usize << 16) / (n_tokens * cols).max(1);
    let min_rows = if n_tokens > 1 { 16 } else { 4 };
    let rows_per_task = rows_for_work
        .max(min_rows)
        .min(rows.div_ceil(pool.threads() * 4))
        .max(1);
    let n_tasks = rows.div_ceil(rows_per_task);
    let yp = SharedMut::new(y);
    let dtype = w.dtype;
    let xq_ref = &xq[..];
    pool.run(n_tasks, |task| {
        let r0 = task * rows_per_task;
        let r1 = (r0 + rows_per_task).min(rows);
        for t0 in (0..n_tokens).step_by(TOKEN_TILE) {
            let t1 = (t0 + TOKEN_TILE).min(n_tokens);
            for r in r0..r1 {
                let wr = w.row(r);
                let mut t = t0;
                while t < t1 {
                    let four = if t + 4 <= t1 {
                        dot4(isa, dtype, cols, wr, &xq_ref[t * xrb..(t + 4) * xrb], xrb)
                    } else {
                        None
                    };
                    let n = if let Some(v) = four {
                        for (k, v) in v.into_iter().enumerate() {
                            // SAFETY: only this task writes rows r0..r1 of any
                            // token, and (t+k) * rows + r < n_tokens * rows.
                            unsafe { yp.slice((t + k) * rows + r, 1)[0] = v };
                        }
                        4
                    } else {
                        let v = dot(isa, dtype, cols, wr, &xq_ref[t * xrb..(t + 1) * xrb]);
                        // SAFETY: as above, for token t.
                        unsafe { yp.slice(t * rows + r, 1)[0] = v };
                        1
                    };
                    t += n;
                }
            }
        }
    });
    XQ_SCRATCH.with(|s| *s.borrow_mut() = xq);
}

/// One weight row × one activation row on `isa` (which must be available).
#[inline]
fn dot(isa: Isa, dtype: DType, cols: usize, w: &[u8], x: &[u8]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512 => {
            // SAFETY: `isa` passed `or_portable`, so AVX2/FMA/F16C (and, for
            // `Avx2Vnni` and `Avx512`, VNNI) are present; `w` is one row of a
            // checked matrix and `x` one row of
            // `ActFormat::for_weight(dtype).row_bytes(cols)` bytes.
            unsafe { crate::avx2::vec_dot(isa != Isa::Avx2, dtype, cols, w, x) }
        }
        _ => quant::vec_dot_portable(dtype, cols, w, x),
    }
}

/// One weight row × four activation rows `stride` bytes apart, where `isa`
/// has a multi-token kernel for `dtype` (bit-identical to four [`dot`]s).
#[inline]
fn dot4(
    isa: Isa,
    dtype: DType,
    cols: usize,
    w: &[u8],
    x: &[u8],
    stride: usize,
) -> Option<[f32; 4]> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx2Vnni | Isa::Avx512 => {
            // SAFETY: the path is available (see `dot`); `x` holds four
            // activation rows of `stride` bytes each.
            unsafe { crate::avx2::vec_dot4(isa != Isa::Avx2, dtype, cols, w, x, stride) }
        }
        _ => None,
    }
}

/// Dot product of one weight row of `dtype` with an activation row already
/// in `ActFormat::for_weight(dtype)`, on `isa` (falls back to portable when
/// unavailable). For tests and for callers that quantize once themselves.
///
/// # Panics
/// If the row lengths do not match `cols`.
#[must_use]
pub fn vec_dot(isa: Isa, dtype: DType, cols: usize, w: &[u8], x: &[u8]) -> f32 {
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
    dot(isa.or_portable(), dtype, cols, w, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_matrix_names_expected_and_actual_sizes() {
        let err = WeightMatrix::new(DType::Q4_1, 3, 64, &[0u8; 100]).unwrap_err();
        assert_eq!(
            err,
            KernelError::WeightSize {
                dtype: DType::Q4_1,
                rows: 3,
                cols: 64,
                expected: 120,
                actual: 100
            }
        );
        assert!(
            err.to_string().contains("needs 120 bytes of data, got 100"),
            "{err}"
        );
        assert!(matches!(
            WeightMatrix::new(DType::Q8_0, 1, 33, &[0u8; 34]),
            Err(KernelError::ColsNotWholeBlocks { cols: 33, .. })
        ));
    }
}
