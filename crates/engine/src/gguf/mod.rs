//! GGUF model files: parse (v2/v3, little-endian), look up metadata and tensors, and write small
//! files for tests.
//!
//! Shape of the API: parsing produces a [`GgufIndex`] (metadata + tensor table, owned); a
//! [`Gguf<B>`] pairs it with any byte owner `B` — a memory map ([`GgufFile`], from
//! [`Gguf::open`]), a `Vec<u8>`, or a borrowed `&[u8]` — so tensor views borrow straight from
//! the mapped file with no copy, and tests can parse bytes they just wrote. The parser treats
//! the file as hostile input (see `reader`); the writer (see `writer`) is the only producer of
//! test models for this and other crates.
//!
//! Unsupported tensor types load fine: the error comes only when such a tensor is turned into a
//! compute operand ([`TensorView::matrix`], [`TensorView::dequantize`]).

mod index;
mod reader;
mod value;
mod writer;

#[cfg(test)]
mod tests;

use std::ops::Deref;
use std::path::Path;

pub use index::{GgufIndex, TensorInfo};
pub use value::{Array, Value, ValueType};
pub use writer::GgufWriter;

use crate::error::{EngineError, Result};
use crate::quant::{GgmlType, QMatrix};

/// A parsed GGUF file together with the bytes it was parsed from.
#[derive(Debug)]
pub struct Gguf<B> {
    bytes: B,
    index: GgufIndex,
}

/// A GGUF file memory-mapped from disk.
pub type GgufFile = Gguf<memmap2::Mmap>;

impl Gguf<memmap2::Mmap> {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::parse(map_file(path.as_ref())?)
    }
}

/// Memory-maps a model file read-only, the one place the engine maps files.
pub fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let io = |source| EngineError::Io { path: path.to_path_buf(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only. Another process truncating or rewriting the model file
    // while it is mapped is outside what we can defend against (as for every mmap-based model
    // loader); the parser validates everything it reads from the mapping.
    unsafe { memmap2::Mmap::map(&file) }.map_err(io)
}

impl<B: AsRef<[u8]>> Gguf<B> {
    /// Parses `bytes` (owned or borrowed) and keeps them for tensor access.
    pub fn parse(bytes: B) -> Result<Self> {
        let index = GgufIndex::parse(bytes.as_ref())?;
        Ok(Self { bytes, index })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    /// The backing store itself (to advise the kernel about a mapping, say).
    pub fn backing(&self) -> &B {
        &self.bytes
    }

    /// The parsed metadata and tensor table (also reachable through `Deref`).
    pub fn index(&self) -> &GgufIndex {
        &self.index
    }

    /// Gives back the bytes.
    pub fn into_bytes(self) -> B {
        self.bytes
    }

    /// The tensor called `name`, of any type. Fails only if it does not exist.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info =
            self.index.tensor_info(name).ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
        Ok(self.view(info))
    }

    /// Every tensor, in file order.
    pub fn tensor_views(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.index.tensors().iter().map(|t| self.view(t))
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> TensorView<'a> {
        // The parser checked that every data range lies inside these bytes; `get` keeps that a
        // non-panicking guarantee even if it were ever violated.
        let data = self.bytes.as_ref().get(info.data_range()).unwrap_or(&[]);
        TensorView { name: &info.name, dims: &info.dims, ty: info.ty, data }
    }
}

impl<B> Deref for Gguf<B> {
    type Target = GgufIndex;
    fn deref(&self) -> &GgufIndex {
        &self.index
    }
}

/// A tensor's description and bytes, borrowed from the file.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Dimensions, innermost first (`[cols, rows]` for a matrix).
    pub dims: &'a [u64],
    /// Element encoding.
    pub ty: GgmlType,
    /// The raw data (`ty`-encoded), exactly the tensor's size.
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        // Views from the parser are overflow-checked; a hand-built view saturates instead.
        self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX)
    }

    /// Errors with the tensor's name if its type cannot be computed with.
    pub fn require_supported(&self) -> Result<()> {
        self.ty.require_supported(self.name)
    }

    /// `(rows, cols)` when viewed as a matrix: cols is `dims[0]`, rows the product of the rest.
    pub fn matrix_shape(&self) -> Result<(usize, usize)> {
        let cols = self.dims.first().copied().unwrap_or(1);
        let rows = self.dims.iter().skip(1).try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
        match (usize::try_from(rows), usize::try_from(cols)) {
            (Ok(r), Ok(c)) => Ok((r, c)),
            _ => Err(EngineError::InvalidModel(format!(
                "tensor `{}` is too large for this platform",
                self.name
            ))),
        }
    }

    /// The tensor as a compute operand (`rows × cols`, see [`TensorView::matrix_shape`]).
    pub fn matrix(&self) -> Result<QMatrix<'a>> {
        self.require_supported()?;
        let (rows, cols) = self.matrix_shape()?;
        QMatrix::new(self.ty, rows, cols, self.data)
    }

    /// The matrix, after checking it has exactly `[cols, rows]` dims.
    pub fn matrix_checked(&self, rows: usize, cols: usize) -> Result<QMatrix<'a>> {
        let want = [cols as u64, rows as u64];
        if self.dims != want {
            return Err(EngineError::shape(
                format!("tensor `{}`", self.name),
                format!("{want:?}"),
                format!("{:?}", self.dims),
            ));
        }
        self.matrix()
    }

    /// All elements as f32, row-major.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        self.matrix()?.dequantize()
    }
}
