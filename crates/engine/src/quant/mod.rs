//! Quantized tensor formats and the kernels that compute with them.
//!
//! The module is split by role so each piece can be tested against a simpler one:
//! - `types`: the ggml type table (ids, block geometry, which types compute supports);
//! - `reference`: scalar dequantize/quantize, the executable definition of each block layout;
//! - `activation`: activation vectors quantized once per matvec to 8-bit blocks;
//! - `dot_scalar` / `dot_avx2`: row · activation kernels, portable and AVX2+FMA+F16C;
//! - `tile_avx2`: register tiles (rows × activations) for the 32-block types, the one kernel
//!   behind their matvec and batched products, so every pair is computed identically;
//! - `matrix`: [`QMatrix`], a borrowed 2-D weight with rayon-parallel matvec and dequantize;
//! - `interleave`: [`Interleaved`], Q4_1/Q8_0/Q5_0/Q4_K/Q6_K weights repacked eight rows at a time
//!   (`interleave_pack`: the layouts), the kernel the forward pass uses for every product of
//!   those types; `interleave_avx2` and `interleave_avx512`: the same products eight and sixteen
//!   rows at a time, bit-identical to the portable one.
//!
//! The functions here are the checked entry points: they validate lengths and types and return
//! [`EngineError`] instead of panicking, then call the unchecked kernels. The kernel family is
//! chosen at run time ([`Kernel::best`]); tests can force the scalar path to compare both.

mod activation;
#[cfg(target_arch = "x86_64")]
mod activation_avx512;
pub mod amx_bf16;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
mod dot_scalar;
mod interleave;
#[cfg(target_arch = "x86_64")]
mod interleave_amx;
#[cfg(target_arch = "x86_64")]
mod interleave_avx2;
#[cfg(target_arch = "x86_64")]
mod interleave_avx512;
mod interleave_pack;
mod matrix;
mod reference;
#[cfg(target_arch = "x86_64")]
mod tile_avx2;
mod types;

#[cfg(test)]
mod tests;

pub use activation::{BlockQ8K, BlockQ8x32, QuantizedActivation};
pub use interleave::{
    matmul_group_interleaved, matmul_group_interleaved_with, matmul_swiglu_interleaved, Interleaved,
};
pub use matrix::{matmul_group, QMatrix};
pub use types::{ActivationKind, GgmlType};

use crate::error::{EngineError, Result};

/// Which implementation of the dot kernels to run, slowest first (`Ord` follows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kernel {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86_64 AVX2 + FMA + F16C. Requesting it on a CPU without those falls back to `Scalar`.
    Avx2,
    /// AVX2's, plus AVX-512 F/BW/VL/VNNI for the repacked products (sixteen rows per
    /// `vpdpbusd`); the row-layout kernels stay AVX2's. Bit-identical to the other paths.
    Avx512,
    /// AVX-512's, plus AMX-INT8 tiles for repacked products of 64 or more activations
    /// (prefill: 16 × 16 dots per `tdpbssd`). Bit-identical to the other paths; the default
    /// where the CPU has it and Linux grants the tile state (docs/engine.md, Kernel paths).
    Amx,
}

/// Caps the kernel family at run time (`scalar`, `avx2`, `avx512`, `amx`): what a CPU without a feature
/// would run, on one that has it — for tests of the dispatch and for comparisons.
pub const KERNEL_ENV: &str = "TOKENPATH_KERNEL";

impl Kernel {
    /// Every family, slowest first.
    pub const ALL: [Kernel; 4] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512, Kernel::Amx];

    /// The fastest kernel family this CPU supports, at most [`KERNEL_ENV`]'s when set (read
    /// once per process; an unknown value is ignored with a warning); at most
    /// [`Kernel::DEFAULT_CAP`] when not.
    pub fn best() -> Kernel {
        static BEST: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let cap = std::env::var(KERNEL_ENV).ok();
            let parsed = cap.as_deref().map(str::parse::<Kernel>);
            if let Some(Err(e)) = &parsed {
                tracing::warn!("{KERNEL_ENV}: {e}; using the fastest kernels this CPU has");
            }
            Kernel::pick(parsed.and_then(Result::ok), Kernel::is_available)
        })
    }

    /// The highest family picked without [`KERNEL_ENV`]: every family.
    pub const DEFAULT_CAP: Kernel = Kernel::Amx;

    /// The fastest family at or below `cap` (default [`Kernel::DEFAULT_CAP`]) that `available`
    /// says this CPU runs.
    pub fn pick(cap: Option<Kernel>, available: impl Fn(Kernel) -> bool) -> Kernel {
        let cap = cap.unwrap_or(Kernel::DEFAULT_CAP);
        Kernel::ALL.into_iter().rev().find(|k| *k <= cap && available(*k)).unwrap_or(Kernel::Scalar)
    }

    /// Its name, as [`KERNEL_ENV`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512",
            Kernel::Amx => "amx",
        }
    }

    /// Whether this CPU can run the kernel family.
    pub fn is_available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                Kernel::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => Kernel::Avx512.is_available() && interleave_amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            Kernel::Avx2 | Kernel::Avx512 | Kernel::Amx => false,
        }
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Kernel {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        Kernel::ALL.into_iter().find(|k| k.name() == s.trim()).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "unknown kernel family {s:?} (expected scalar, avx2 or avx512)"
            ))
        })
    }
}

/// The first `K` items of `s` as an array, for the tiles' const-width activation lists:
/// `array::from_fn`'s per-item closure calls are not inlined into the target-feature kernels
/// that take the array (7% of a prefill when they were). Panics when `s` is shorter; the callers
/// match on its length first.
#[inline(always)]
pub(crate) fn first<T: Copy, const K: usize>(s: &[T]) -> [T; K] {
    match <[T; K]>::try_from(&s[..K]) {
        Ok(a) => a,
        Err(_) => unreachable!("a slice of K items converts to [T; K]"),
    }
}

fn unsupported(ty: GgmlType, what: &str) -> EngineError {
    EngineError::UnsupportedTensorType {
        name: what.to_string(),
        ty: ty.name().to_string(),
        supported: GgmlType::supported_list(),
    }
}

/// Bytes taken by `n` elements of `ty`; an error if `n` is not a whole number of blocks.
pub fn row_bytes(ty: GgmlType, n: usize) -> Result<usize> {
    ty.bytes_for(n as u64).and_then(|b| usize::try_from(b).ok()).ok_or_else(|| {
        EngineError::shape(
            format!("{ty} row"),
            format!("a multiple of the block size {}", ty.block_size()),
            format!("{n} elements"),
        )
    })
}

/// An error unless `len` is the element count of a `rows × cols` matrix.
pub(crate) fn check_matrix_len(rows: usize, cols: usize, len: usize) -> Result<()> {
    if Some(len) != rows.checked_mul(cols) {
        return Err(EngineError::shape("dequantized matrix length", format!("{rows} x {cols}"), len));
    }
    Ok(())
}

/// Dequantizes `bytes` (whole blocks of `ty`) into `out`; `out.len()` fixes the element count.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if !ty.is_supported() {
        return Err(unsupported(ty, "dequantize input"));
    }
    let need = row_bytes(ty, out.len())?;
    if bytes.len() != need {
        return Err(EngineError::shape(
            format!("dequantize of {} {ty} elements", out.len()),
            format!("{need} bytes"),
            format!("{} bytes", bytes.len()),
        ));
    }
    reference::dequantize(ty, bytes, out);
    Ok(())
}

/// Dequantizes `n_elements` elements of `ty` from `bytes` into a new vector.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    // Check before allocating, so a wrong count cannot request a huge buffer.
    if row_bytes(ty, n_elements)? != bytes.len() {
        return Err(EngineError::shape(
            format!("dequantize of {n_elements} {ty} elements"),
            format!("{} bytes", row_bytes(ty, n_elements)?),
            format!("{} bytes", bytes.len()),
        ));
    }
    let mut out = vec![0f32; n_elements];
    dequantize_row(ty, bytes, &mut out)?;
    Ok(out)
}

/// Quantizes `x` (whole blocks) to `ty`. Implemented for F32, F16, Q8_0, Q4_0 and Q4_1 with
/// ggml's reference rounding; meant for writing test models, not for speed.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(row_bytes(ty, x.len())?);
    if reference::quantize(ty, x, &mut out) {
        Ok(out)
    } else {
        Err(EngineError::InvalidArgument(format!(
            "quantizing to {ty} is not implemented; available: F32, F16, Q8_0, Q4_0, Q4_1"
        )))
    }
}

/// Dot product of one weight row of `ty` with a prepared activation, using the best kernel.
pub fn vec_dot(ty: GgmlType, row: &[u8], act: &QuantizedActivation) -> Result<f32> {
    vec_dot_with(Kernel::best(), ty, row, act)
}

/// [`vec_dot`] with an explicit kernel family (tests compare `Scalar` with `Avx2`).
pub fn vec_dot_with(kernel: Kernel, ty: GgmlType, row: &[u8], act: &QuantizedActivation) -> Result<f32> {
    check_dot(ty, row.len(), act)?;
    // SAFETY: checked just above; `resolve` looked at this CPU.
    Ok(unsafe { dot_unchecked(kernel.resolve(), ty, row, act) })
}

/// Validates that `row_len` bytes of `ty` pair with `act`.
pub(crate) fn check_dot(ty: GgmlType, row_len: usize, act: &QuantizedActivation) -> Result<()> {
    let kind = ty.activation_kind().ok_or_else(|| unsupported(ty, "dot product operand"))?;
    if kind != act.kind() {
        return Err(EngineError::shape(
            format!("activation for {ty} weights"),
            format!("{kind:?} activation"),
            format!("{:?} activation", act.kind()),
        ));
    }
    let need = row_bytes(ty, act.len())?;
    if row_len != need {
        return Err(EngineError::shape(
            format!("{ty} row for an activation of {} elements", act.len()),
            format!("{need} bytes"),
            format!("{row_len} bytes"),
        ));
    }
    Ok(())
}

/// A kernel choice checked against the CPU once (per matvec, not per row). Only
/// [`Kernel::resolve`] builds one, so `Resolved(true)` proves AVX2+FMA+F16C were detected.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resolved(bool);

impl Kernel {
    pub(crate) fn resolve(self) -> Resolved {
        Resolved(self >= Kernel::Avx2 && Kernel::Avx2.is_available())
    }
}

/// Where a block of results goes: pair (row `first_row + i`, activation `first_col + j`) is
/// written to `out[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub first_row: usize,
    pub rows: usize,
    pub first_col: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

/// Activations prepared once per product for [`rows_times_acts_unchecked`]: on AVX2, packed for
/// the register tiles of the 32-block types.
pub(crate) struct Packed<'a> {
    acts: &'a [QuantizedActivation],
    #[cfg(target_arch = "x86_64")]
    tiles: Option<tile_avx2::Pack<'a>>,
}

impl<'a> Packed<'a> {
    pub(crate) fn new(kernel: Resolved, ty: GgmlType, acts: &'a [QuantizedActivation]) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let tiles =
                (kernel.0 && matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)).then(|| {
                    let ys = acts
                        .iter()
                        .map(|a| match a {
                            QuantizedActivation::Q8x32(v) => v.as_slice(),
                            _ => &[],
                        })
                        .collect();
                    tile_avx2::Pack::new(ty, ys)
                });
            Packed { acts, tiles }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (kernel, ty);
            Packed { acts }
        }
    }
}

/// The pairs of `span` (rows of `data`, activations of `packed`, all checked with
/// [`check_dot`] against `ty` and `row_bytes`), written into `out` as `span` says. On AVX2 the
/// 32-block types run register tiles of several rows × several activations; every pair's result
/// is bit-identical to [`dot_unchecked`] on its own, so batching never changes an output.
///
/// # Safety
/// [`check_dot`] passed for `ty`, `row_bytes` and every activation of `packed`; `span`'s rows lie
/// in `data` and its pairs in `out`; a `Resolved(true)` kernel was resolved on this CPU. The
/// vector kernels read by those lengths unchecked.
pub(crate) unsafe fn rows_times_acts_unchecked(
    kernel: Resolved,
    ty: GgmlType,
    data: &[u8],
    row_bytes: usize,
    packed: &Packed<'_>,
    span: Span,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(p) = &packed.tiles {
        debug_assert_eq!(p.len(), packed.acts.len());
        // SAFETY: a pack exists only when `Resolved(true)` (CPU features detected); `check_dot`
        // matched every activation's length and kind to the rows, and `span` lies inside `data`
        // and `out` (built by the callers in `matrix.rs`).
        unsafe { tile_avx2::rows_times_acts(ty, data, row_bytes, p, span, out) };
        return;
    }
    for i in 0..span.rows {
        let r = span.first_row + i;
        let row = &data[r * row_bytes..(r + 1) * row_bytes];
        for j in 0..span.cols {
            // SAFETY: the caller's contract (`check_dot` for every activation of `packed`).
            out[i * span.row_stride + j * span.col_stride] =
                unsafe { dot_unchecked(kernel, ty, row, &packed.acts[span.first_col + j]) };
        }
    }
}

/// The dot kernel without checks.
///
/// # Safety
/// [`check_dot`] passed for `ty`, `row.len()` and `act`, and a `Resolved(true)` kernel was
/// resolved on this CPU: the vector kernels read `row` and `act` by those lengths unchecked.
#[inline]
pub(crate) unsafe fn dot_unchecked(
    kernel: Resolved,
    ty: GgmlType,
    row: &[u8],
    act: &QuantizedActivation,
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if kernel.0 {
        // SAFETY: `Resolved(true)` means the CPU features were detected, and `check_dot`
        // matched the lengths.
        // Types without an AVX2 row kernel (Q5_0: its matrices run repacked, in their own layout) fall
        // through to the portable one below.
        let fast = unsafe {
            match (ty, act) {
                (GgmlType::F32, QuantizedActivation::F32(x)) => Some(dot_avx2::dot_f32(row, x)),
                (GgmlType::F16, QuantizedActivation::F32(x)) => Some(dot_avx2::dot_f16(row, x)),
                (GgmlType::Q4_0, QuantizedActivation::Q8x32(y)) => Some(dot_avx2::dot_q4_0(row, y)),
                (GgmlType::Q4_1, QuantizedActivation::Q8x32(y)) => Some(dot_avx2::dot_q4_1(row, y)),
                (GgmlType::Q8_0, QuantizedActivation::Q8x32(y)) => Some(dot_avx2::dot_q8_0(row, y)),
                (GgmlType::Q4_K, QuantizedActivation::Q8K(y)) => Some(dot_avx2::dot_q4_k(row, y)),
                (GgmlType::Q6_K, QuantizedActivation::Q8K(y)) => Some(dot_avx2::dot_q6_k(row, y)),
                _ => None,
            }
        };
        if let Some(v) = fast {
            return v;
        }
    }
    let _ = kernel;
    match (ty, act) {
        (GgmlType::F32, QuantizedActivation::F32(x)) => dot_scalar::dot_f32(row, x),
        (GgmlType::F16, QuantizedActivation::F32(x)) => dot_scalar::dot_f16(row, x),
        (GgmlType::Q4_0, QuantizedActivation::Q8x32(y)) => dot_scalar::dot_q4_0(row, y),
        (GgmlType::Q4_1, QuantizedActivation::Q8x32(y)) => dot_scalar::dot_q4_1(row, y),
        (GgmlType::Q8_0, QuantizedActivation::Q8x32(y)) => dot_scalar::dot_q8_0(row, y),
        (GgmlType::Q5_0, QuantizedActivation::Q8x32(y)) => dot_scalar::dot_q5_0(row, y),
        (GgmlType::Q4_K, QuantizedActivation::Q8K(y)) => dot_scalar::dot_q4_k(row, y),
        (GgmlType::Q6_K, QuantizedActivation::Q8K(y)) => dot_scalar::dot_q6_k(row, y),
        // Excluded by `check_dot`; a NaN is louder than a silent zero if that ever changes.
        _ => f32::NAN,
    }
}
