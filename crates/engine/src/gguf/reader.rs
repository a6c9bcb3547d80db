//! The GGUF parser: bytes in, [`GgufIndex`] out, for hostile input.
//!
//! Everything read from the file is untrusted. The rules, enforced in one place (`Cursor`):
//! - every length or count is checked against the bytes still unread *before* anything is
//!   allocated, using the smallest possible encoding of one element (a file claiming 2^60
//!   strings fails at once, without allocating);
//! - nesting of arrays is capped, so recursion depth is bounded;
//! - arithmetic on sizes and offsets is checked; tensor byte ranges must lie inside the file;
//! - errors carry the byte offset where parsing stopped.
//!
//! Layout (little-endian; v2 and v3 are identical, v3 only adds the big-endian variant, which
//! is rejected with a clear message): magic `GGUF`, u32 version, u64 tensor count, u64 metadata
//! count, metadata `(string key, u32 type, value)*`, tensor infos `(string name, u32 n_dims,
//! u64 dims[n_dims], u32 ggml type, u64 offset)*`, padding to `general.alignment` (default 32),
//! then the data section; tensor offsets are relative to it and aligned.

use std::collections::HashMap;

use super::index::{GgufIndex, TensorInfo};
use super::value::{Array, Value, ValueType};
use crate::error::{EngineError, Result};
use crate::quant::GgmlType;

/// Deepest array nesting accepted (real files use 1).
const MAX_ARRAY_DEPTH: usize = 8;
/// ggml's limit on tensor rank.
const MAX_DIMS: u32 = 4;
/// Alignment when `general.alignment` is absent.
pub(crate) const DEFAULT_ALIGNMENT: u32 = 32;

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, reason: impl Into<String>) -> EngineError {
        EngineError::gguf(self.pos as u64, reason)
    }

    fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "unexpected end of file reading {what}: need {n} bytes, {} left (truncated file?)",
                self.remaining()
            )));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a u64 count of items each at least `min_size` bytes long, and checks that many
    /// items could fit in the rest of the file.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min_size))
            .is_some_and(|bytes| bytes <= self.remaining());
        if !fits {
            return Err(EngineError::gguf(
                at as u64,
                format!(
                    "{what} is {n}, but only {} bytes remain (each item needs at least {min_size})",
                    self.remaining()
                ),
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.count(&format!("length of {what}"), 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| EngineError::gguf(at as u64, format!("{what} is not valid UTF-8: {e}")))
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| {
            EngineError::gguf(at as u64, format!("unknown metadata value type {id} for {what}"))
        })
    }

    fn value(&mut self, ty: ValueType, what: &str, depth: usize) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(what)?[0] != 0),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(what, depth)?),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    fn array_value(&mut self, what: &str, depth: usize) -> Result<Array> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.err(format!("{what}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels")));
        }
        let ety = self.value_type(&format!("element type of {what}"))?;
        let n = self.count(&format!("element count of {what}"), ety.min_encoded_size())?;
        macro_rules! fixed {
            ($v:ident, $t:ty) => {{
                let raw = self.take(n * std::mem::size_of::<$t>(), what)?;
                Array::$v(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| {
                            let mut a = [0u8; std::mem::size_of::<$t>()];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ety {
            ValueType::U8 => Array::U8(self.take(n, what)?.to_vec()),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool => Array::Bool(self.take(n, what)?.iter().map(|&b| b != 0).collect()),
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&format!("{what}[{i}]"))?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(&format!("{what}[{i}]"), depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

/// Parses the header, metadata and tensor table of a GGUF file held in `bytes`.
pub(crate) fn parse(bytes: &[u8]) -> Result<GgufIndex> {
    let mut c = Cursor { b: bytes, pos: 0 };
    let magic = c.array::<4>("magic")?;
    if &magic != b"GGUF" {
        return Err(EngineError::gguf(
            0,
            format!("not a GGUF file: magic bytes are {magic:02x?}, expected \"GGUF\""),
        ));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 2 | 3) => {
            return Err(EngineError::gguf(4, "big-endian GGUF files are not supported"));
        }
        1 => return Err(EngineError::gguf(4, "GGUF version 1 is not supported (supported: 2, 3)")),
        v => return Err(EngineError::gguf(4, format!("unsupported GGUF version {v} (supported: 2, 3)"))),
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.count("metadata count", 8 + 4 + 1)?;
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv);
    let mut meta_index: HashMap<String, usize> = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.string(&format!("key of metadata entry {i}"))?;
        let ty = c.value_type(&format!("type of metadata `{key}`"))?;
        let value = c.value(ty, &format!("metadata `{key}`"), 0)?;
        if meta_index.insert(key.clone(), metadata.len()).is_some() {
            return Err(EngineError::gguf(at as u64, format!("duplicate metadata key `{key}`")));
        }
        metadata.push((key, value));
    }

    let alignment = match meta_index.get("general.alignment").and_then(|&i| metadata.get(i)).map(|(_, v)| v) {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_i128().and_then(|a| u32::try_from(a).ok()) {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(EngineError::gguf(
                    c.pos as u64,
                    format!("general.alignment must be a power of two, got {}", v.describe()),
                ))
            }
        },
    };

    let n_tensors = usize::try_from(n_tensors)
        .ok()
        .filter(|n| n.checked_mul(8 + 4 + 4 + 8).is_some_and(|b| b <= c.remaining()))
        .ok_or_else(|| {
            EngineError::gguf(
                8,
                format!(
                    "tensor count is {n_tensors}, but only {} bytes remain for tensor infos",
                    c.remaining()
                ),
            )
        })?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(n_tensors);
    let mut info_offsets = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let at = c.pos;
        let name = c.string(&format!("name of tensor {i}"))?;
        let n_dims = c.u32(&format!("rank of tensor `{name}`"))?;
        if n_dims > MAX_DIMS {
            return Err(
                c.err(format!("tensor `{name}` has {n_dims} dimensions; at most {MAX_DIMS} are allowed"))
            );
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for _ in 0..n_dims {
            let d = c.u64(&format!("dimensions of tensor `{name}`"))?;
            n_elements = n_elements
                .checked_mul(d)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| c.err(format!("tensor `{name}`: element count overflows")))?;
            dims.push(d);
        }
        let type_at = c.pos;
        let type_id = c.u32(&format!("type of tensor `{name}`"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| {
            EngineError::gguf(type_at as u64, format!("tensor `{name}` has unknown ggml type id {type_id}"))
        })?;
        let row = dims.first().copied().unwrap_or(1);
        if row % ty.block_size() as u64 != 0 {
            return Err(EngineError::gguf(
                type_at as u64,
                format!(
                    "tensor `{name}`: row length {row} is not a multiple of the {ty} block size {}",
                    ty.block_size()
                ),
            ));
        }
        let n_bytes =
            ty.bytes_for(n_elements).ok_or_else(|| c.err(format!("tensor `{name}`: byte size overflows")))?;
        let offset = c.u64(&format!("data offset of tensor `{name}`"))?;
        if offset % alignment as u64 != 0 {
            return Err(c.err(format!(
                "tensor `{name}`: data offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        if tensor_index.insert(name.clone(), tensors.len()).is_some() {
            return Err(EngineError::gguf(at as u64, format!("duplicate tensor name `{name}`")));
        }
        info_offsets.push(at);
        tensors.push(TensorInfo { name, dims, ty, offset, n_elements, n_bytes, start: 0 });
    }

    let data_offset =
        c.pos.checked_next_multiple_of(alignment as usize).ok_or_else(|| c.err("data offset overflows"))?;
    for (t, &at) in tensors.iter_mut().zip(&info_offsets) {
        let range = usize::try_from(t.offset)
            .ok()
            .and_then(|o| o.checked_add(data_offset))
            .and_then(|s| Some((s, s.checked_add(usize::try_from(t.n_bytes).ok()?)?)));
        match range {
            Some((start, end)) if end <= bytes.len() => t.start = start,
            _ => {
                return Err(EngineError::gguf(
                    at as u64,
                    format!(
                        "tensor `{}` data ({} bytes at data offset {}) extends past the end of the \
                         file ({} bytes; data section starts at {data_offset}); truncated file?",
                        t.name,
                        t.n_bytes,
                        t.offset,
                        bytes.len()
                    ),
                ))
            }
        }
    }

    Ok(GgufIndex { version, alignment, data_offset, metadata, meta_index, tensors, tensor_index })
}
