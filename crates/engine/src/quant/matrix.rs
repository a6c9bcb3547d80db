//! [`QMatrix`]: a borrowed quantized 2-D weight (usually straight out of the memory-mapped GGUF)
//! and the operations the forward pass needs from it.
//!
//! Shape convention is ggml's: a tensor with dims `[cols, rows]` is stored row-major with `cols`
//! contiguous elements per row, and `y = W x` has `y.len() == rows`, `x.len() == cols`. Matvec
//! quantizes `x` once, then splits rows over rayon tasks sized to a few tens of KB of weights, so
//! decode streams the weights at memory bandwidth on all cores while tiny matrices stay on the
//! calling thread. `matmul` / [`matmul_group`] run many activations (batched decode): register
//! tiles reuse each unpacked weight block for several sequences and each activation block for
//! several rows, with results bit-identical to one matvec per sequence; a group of matrices that
//! read the same input (Q, K, V) runs as one parallel region.

use rayon::prelude::*;

use super::{
    check_dot, dot_unchecked, row_bytes, rows_times_acts_unchecked, ActivationKind, GgmlType, Kernel, Packed,
    QuantizedActivation, Span,
};
use crate::error::{EngineError, Result};

/// Bytes of weights one rayon task should process; below twice this, run on the caller's thread.
const TASK_BYTES: usize = 32 * 1024;
/// From this many activations on, products split over activations instead of rows.
const SPLIT_COLS_FROM: usize = 32;
/// Activations per task when splitting over activations.
const COLS_PER_TASK: usize = 32;

/// Every row of `x` (`rows × cols`, row-major) quantized as `kind`, in parallel for large batches.
pub(crate) fn prepare_rows_as(
    kind: ActivationKind,
    cols: usize,
    x: &[f32],
) -> Result<Vec<QuantizedActivation>> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(EngineError::shape("matmul input length", format!("a multiple of {cols}"), x.len()));
    }
    if x.len() / cols >= 8 {
        x.par_chunks_exact(cols).map(|row| QuantizedActivation::new(kind, row)).collect()
    } else {
        x.chunks_exact(cols).map(|row| QuantizedActivation::new(kind, row)).collect()
    }
}

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

    /// Prepares every row of `x` (`rows × cols`, row-major) with [`QMatrix::prepare_input`],
    /// in parallel for large batches.
    pub fn prepare_rows(&self, x: &[f32]) -> Result<Vec<QuantizedActivation>> {
        prepare_rows_as(self.activation_kind()?, self.cols, x)
    }

    /// Quantizes an input vector the way this matrix's dot kernel wants it. Reuse the result
    /// for several matrices of the same activation kind (e.g. Q, K and V projections).
    pub fn prepare_input(&self, x: &[f32]) -> Result<QuantizedActivation> {
        if x.len() != self.cols {
            return Err(EngineError::shape("matvec input length", self.cols, x.len()));
        }
        QuantizedActivation::new(self.activation_kind()?, x)
    }

    fn activation_kind(&self) -> Result<ActivationKind> {
        self.ty
            .activation_kind()
            .ok_or_else(|| EngineError::InvalidArgument(format!("{} has no dot kernel", self.ty)))
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
                // SAFETY: `check_dot` passed for this matrix's rows and `act` above; `resolve`
                // looked at this CPU.
                *o = unsafe { dot_unchecked(kernel, self.ty, row, act) };
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
        matmul_group(&[*self], acts, &mut [out])
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
        super::check_matrix_len(self.rows, self.cols, out.len())?;
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

/// [`QMatrix::matmul`] for several matrices that read the same activations (Q, K and V; gate and
/// up): `outs[i][b * rows_i + r] = mats[i].row(r) · acts[b]`. All their rows go to the thread pool
/// as one parallel region, so a decode step pays one fork/join per group, not one per matrix.
pub fn matmul_group(
    mats: &[QMatrix<'_>],
    acts: &[QuantizedActivation],
    outs: &mut [&mut [f32]],
) -> Result<()> {
    let n = acts.len();
    if mats.len() != outs.len() {
        return Err(EngineError::shape("matmul group outputs", mats.len(), outs.len()));
    }
    for (m, out) in mats.iter().zip(outs.iter()) {
        for a in acts {
            check_dot(m.ty, m.row_bytes, a)?;
        }
        if Some(out.len()) != m.rows.checked_mul(n) {
            return Err(EngineError::shape("matmul output length", format!("{} x {n}", m.rows), out.len()));
        }
    }
    if n == 0 {
        return Ok(());
    }
    let kernel = Kernel::best().resolve();
    let packs: Vec<Packed<'_>> = mats.iter().map(|m| Packed::new(kernel, m.ty, acts)).collect();
    let total: usize = mats.iter().map(|m| m.data.len()).sum();
    let serial = total.saturating_mul(n) < 2 * TASK_BYTES;
    if n >= SPLIT_COLS_FROM {
        // Prefill-sized batches: a task owns a run of activations and every row, which in the
        // output's `[activation][row]` layout is one contiguous slice, so results are written in
        // place. Each task streams the (cache-resident) weights once.
        let mut tasks = Vec::new();
        for ((m, p), out) in mats.iter().zip(&packs).zip(outs.iter_mut()) {
            for (t, chunk) in out.chunks_mut(COLS_PER_TASK * m.rows).enumerate() {
                let span = Span {
                    first_row: 0,
                    rows: m.rows,
                    first_col: t * COLS_PER_TASK,
                    cols: chunk.len() / m.rows,
                    row_stride: 1,
                    col_stride: m.rows,
                };
                tasks.push((m, p, span, chunk));
            }
        }
        run_tasks(kernel, tasks, serial);
        return Ok(());
    }
    // Decode-sized batches: a task owns a run of rows (weights streamed from memory once, split
    // over the cores) and writes them row-major `[row][activation]`; the small result is then
    // transposed (a plain copy for one activation).
    let mut tmps: Vec<Vec<f32>> = outs.iter().map(|o| vec![0f32; o.len()]).collect();
    let mut tasks = Vec::new();
    for ((m, p), tmp) in mats.iter().zip(&packs).zip(tmps.iter_mut()) {
        let per_task = (TASK_BYTES / m.row_bytes.max(1) / n.div_ceil(4)).clamp(8, 64);
        for (t, chunk) in tmp.chunks_mut(per_task * n).enumerate() {
            let span = Span {
                first_row: t * per_task,
                rows: chunk.len() / n,
                first_col: 0,
                cols: n,
                row_stride: n,
                col_stride: 1,
            };
            tasks.push((m, p, span, chunk));
        }
    }
    run_tasks(kernel, tasks, serial);
    for ((m, tmp), out) in mats.iter().zip(&tmps).zip(outs.iter_mut()) {
        if n == 1 {
            out.copy_from_slice(tmp);
            continue;
        }
        for (r, vals) in tmp.chunks_exact(n).enumerate() {
            for (b, &v) in vals.iter().enumerate() {
                out[b * m.rows + r] = v;
            }
        }
    }
    Ok(())
}

/// One product task: a matrix, its packed activations, the pairs to compute and where they go.
type Task<'t, 'a> = (&'t QMatrix<'a>, &'t Packed<'t>, Span, &'t mut [f32]);

/// Runs `tasks` on the calling thread or as one parallel region. Every task comes from this
/// file's products, built after `check_dot` passed for its matrix and activations: the module
/// keeps [`rows_times_acts_unchecked`]'s contract for it.
fn run_tasks(kernel: super::Resolved, tasks: Vec<Task<'_, '_>>, serial: bool) {
    let run = |(m, p, span, chunk): Task<'_, '_>| {
        // SAFETY: every task is built by this file's products after `check_dot` passed for its
        // matrix and activations, with its span inside the matrix and its output chunk.
        unsafe { rows_times_acts_unchecked(kernel, m.ty, m.data, m.row_bytes, p, span, chunk) }
    };
    if serial {
        tasks.into_iter().for_each(run);
    } else {
        // Each task taken out of its slot exactly once, by whichever thread runs its index.
        let slots: Vec<std::sync::Mutex<Option<Task<'_, '_>>>> =
            tasks.into_iter().map(|t| std::sync::Mutex::new(Some(t))).collect();
        crate::par::for_each(slots.len(), |i| {
            if let Some(task) = slots[i].lock().ok().and_then(|mut s| s.take()) {
                run(task);
            }
        });
    }
}
