//! [`QMatrix`]: a borrowed quantized 2-D weight (usually straight out of the memory-mapped GGUF)
//! and the operations the forward pass needs from it.
//!
//! Shape convention is ggml's: a tensor with dims `[cols, rows]` is stored row-major with `cols`
//! contiguous elements per row, and `y = W x` has `y.len() == rows`, `x.len() == cols`. Matvec
//! quantizes `x` once, then splits rows over rayon tasks sized to a few tens of KB of weights, so
//! decode streams the weights at memory bandwidth on all cores while tiny matrices stay on the
//! calling thread. `matmul` runs several activations per row (batched decode): each weight row is
//! read from memory once and reused from L1 for every sequence, with results bit-identical to
//! one matvec per sequence.

use rayon::prelude::*;

use super::{check_dot, dot_many_unchecked, dot_unchecked, row_bytes, GgmlType, Kernel, QuantizedActivation};
use crate::error::{EngineError, Result};

/// Bytes of weights one rayon task should process; below twice this, run on the caller's thread.
const TASK_BYTES: usize = 32 * 1024;

/// A quantized matrix `[rows × cols]` borrowing its bytes.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Wraps `data` as `rows × cols` elements of `ty`. Fails if `ty` is not supported for
    /// compute, `cols` is not a whole number of blocks, or `data` has the wrong length.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        ty.require_supported("matrix operand")?;
        let row_bytes = row_bytes(ty, cols)?;
        let need = row_bytes.checked_mul(rows);
        if need != Some(data.len()) {
            return Err(EngineError::shape(
                format!("{ty} matrix of {rows} x {cols}"),
                need.map_or_else(|| "a size that fits in memory".to_string(), |n| format!("{n} bytes")),
                format!("{} bytes", data.len()),
            ));
        }
        Ok(Self { ty, rows, cols, row_bytes, data })
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows (output length of matvec).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns (input length of matvec).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The raw bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Raw bytes of row `i`, or `None` if out of range.
    pub fn row(&self, i: usize) -> Option<&'a [u8]> {
        let start = i.checked_mul(self.row_bytes)?;
        self.data.get(start..start.checked_add(self.row_bytes)?)
    }

    /// Quantizes an input vector the way this matrix's dot kernel wants it. Reuse the result
    /// for several matrices of the same activation kind (e.g. Q, K and V projections).
    pub fn prepare_input(&self, x: &[f32]) -> Result<QuantizedActivation> {
        if x.len() != self.cols {
            return Err(EngineError::shape("matvec input length", self.cols, x.len()));
        }
        let kind = self
            .ty
            .activation_kind()
            .ok_or_else(|| EngineError::InvalidArgument(format!("{} has no dot kernel", self.ty)))?;
        QuantizedActivation::new(kind, x)
    }

    /// `y = W x`, with the best kernel, parallel over rows.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        let act = self.prepare_input(x)?;
        self.matvec_prepared(&act, y)
    }

    /// `y = W x` for an input already prepared with [`QMatrix::prepare_input`].
    pub fn matvec_prepared(&self, act: &QuantizedActivation, y: &mut [f32]) -> Result<()> {
        self.matvec_with(Kernel::best(), act, y)
    }

    /// [`QMatrix::matvec_prepared`] with an explicit kernel family.
    pub fn matvec_with(&self, kernel: Kernel, act: &QuantizedActivation, y: &mut [f32]) -> Result<()> {
        check_dot(self.ty, self.row_bytes, act)?;
        let kernel = kernel.resolve();
        if y.len() != self.rows {
            return Err(EngineError::shape("matvec output length", self.rows, y.len()));
        }
        let per_task = (TASK_BYTES / self.row_bytes.max(1)).max(1);
        let run = |first: usize, out: &mut [f32]| {
            for (k, o) in out.iter_mut().enumerate() {
                let r = first + k;
                let row = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
                *o = dot_unchecked(kernel, self.ty, row, act);
            }
        };
        if self.data.len() < 2 * TASK_BYTES {
            run(0, y);
        } else {
            y.par_chunks_mut(per_task).enumerate().for_each(|(t, out)| run(t * per_task, out));
        }
        Ok(())
    }

    /// Batched matvec: `out[b * rows + r] = W[r] · acts[b]` for every activation `b`. Each
    /// weight row is loaded once for the whole batch (and, for Q4_0/Q4_1/Q8_0 on AVX2, each
    /// block unpacked once per four activations). Results are bit-identical to
    /// [`QMatrix::matvec_prepared`] per activation, so batching never changes a sequence's output.
    pub fn matmul(&self, acts: &[QuantizedActivation], out: &mut [f32]) -> Result<()> {
        let n = acts.len();
        for a in acts {
            check_dot(self.ty, self.row_bytes, a)?;
        }
        if Some(out.len()) != self.rows.checked_mul(n) {
            return Err(EngineError::shape(
                "matmul output length",
                format!("{} x {n}", self.rows),
                out.len(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let kernel = Kernel::best().resolve();
        // Compute row-major [rows][n] so tasks own contiguous output, then transpose.
        let mut tmp = vec![0f32; out.len()];
        let per_task = (TASK_BYTES / self.row_bytes.max(1)).max(1);
        let run = |first: usize, chunk: &mut [f32]| {
            for (k, o) in chunk.chunks_exact_mut(n).enumerate() {
                let r = first + k;
                let row = &self.data[r * self.row_bytes..(r + 1) * self.row_bytes];
                dot_many_unchecked(kernel, self.ty, row, acts, o);
            }
        };
        if self.data.len() < 2 * TASK_BYTES {
            run(0, &mut tmp);
        } else {
            tmp.par_chunks_mut(per_task * n).enumerate().for_each(|(t, c)| run(t * per_task, c));
        }
        for (r, vals) in tmp.chunks_exact(n).enumerate() {
            for (b, &v) in vals.iter().enumerate() {
                out[b * self.rows + r] = v;
            }
        }
        Ok(())
    }

    /// Dequantizes row `i` into `out` (`out.len() == cols`), e.g. an embedding lookup.
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) -> Result<()> {
        let row = self.row(i).ok_or_else(|| {
            EngineError::InvalidArgument(format!("row {i} out of range for a matrix of {} rows", self.rows))
        })?;
        if out.len() != self.cols {
            return Err(EngineError::shape("dequantized row length", self.cols, out.len()));
        }
        super::dequantize_row(self.ty, row, out)
    }

    /// Dequantizes the whole matrix into `out` (`rows * cols`, row-major), parallel over rows.
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        if Some(out.len()) != self.rows.checked_mul(self.cols) {
            return Err(EngineError::shape(
                "dequantized matrix length",
                format!("{} x {}", self.rows, self.cols),
                out.len(),
            ));
        }
        if self.cols == 0 {
            return Ok(());
        }
        let rows_per_task = (TASK_BYTES / self.row_bytes.max(1)).max(1);
        out.par_chunks_mut(rows_per_task * self.cols)
            .zip(self.data.par_chunks(rows_per_task * self.row_bytes))
            .try_for_each(|(o, d)| super::dequantize_row(self.ty, d, o))
    }

    /// Dequantizes the whole matrix to a new row-major vector.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_into(&mut out)?;
        Ok(out)
    }
}
