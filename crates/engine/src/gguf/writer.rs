//! A small GGUF writer, so tests (in this crate and others) can build model files with random
//! weights instead of depending on a download.
//!
//! It holds everything in memory and emits the canonical layout — header, metadata, tensor
//! infos, padding to the alignment, then each tensor at an aligned offset — which is the same
//! layout the parser expects, so writer → parser round trips exercise the real read path.
//! Values go in through `Into<Value>`; tensors go in either pre-encoded or as f32 that the writer
//! quantizes with [`crate::quant::quantize`].

use std::path::Path;

use super::reader::DEFAULT_ALIGNMENT;
use super::value::{Array, Value};
use crate::error::{EngineError, Result};
use crate::quant::{self, GgmlType};

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    alignment: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        Self { version: 3, alignment: DEFAULT_ALIGNMENT, metadata: Vec::new(), tensors: Vec::new() }
    }

    /// Sets the header version (2 and 3 share the layout; others are written as asked, for
    /// testing the parser's rejection).
    pub fn version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets the data alignment and records it as `general.alignment`.
    pub fn alignment(&mut self, alignment: u32) -> Result<&mut Self> {
        if !alignment.is_power_of_two() {
            return Err(EngineError::InvalidArgument(format!("alignment {alignment} is not a power of two")));
        }
        self.alignment = alignment;
        Ok(self.metadata("general.alignment", alignment))
    }

    /// Adds or replaces a metadata entry (entries keep their first insertion position).
    pub fn metadata(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        let (key, value) = (key.into(), value.into());
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Adds a tensor whose `data` is already encoded as `ty`. `dims` are innermost first.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let n: u64 = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| {
            EngineError::InvalidArgument(format!("tensor `{name}`: element count overflows"))
        })?;
        let need = ty.bytes_for(n).ok_or_else(|| {
            EngineError::InvalidArgument(format!(
                "tensor `{name}`: {n} elements is not a whole number of {ty} blocks"
            ))
        })?;
        if need != data.len() as u64 {
            return Err(EngineError::shape(
                format!("data of tensor `{name}`"),
                format!("{need} bytes"),
                format!("{} bytes", data.len()),
            ));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(EngineError::InvalidArgument(format!("duplicate tensor name `{name}`")));
        }
        self.tensors.push(PendingTensor { name, dims: dims.to_vec(), ty, data });
        Ok(self)
    }

    /// Adds a tensor from f32 values, encoding them as `ty` (F32, F16, Q8_0, Q4_0 or Q4_1).
    pub fn tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = quant::quantize(ty, values)?;
        self.tensor(name, dims, ty, data)
    }

    /// Serializes the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.alignment as usize;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ty.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        out.resize(out.len().next_multiple_of(align), 0);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            out.resize(out.len().next_multiple_of(align), 0);
        }
        out
    }

    /// Serializes the file to `path`.
    pub fn write_to(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes())
            .map_err(|source| EngineError::Io { path: path.to_path_buf(), source })
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            $v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()))
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(out, s)),
        Array::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
    }
}
