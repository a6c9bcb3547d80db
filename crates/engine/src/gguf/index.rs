//! [`GgufIndex`]: what the parser learned about a file (metadata and tensor table), owning its
//! data and borrowing nothing, plus typed metadata accessors.
//!
//! It is separate from the bytes so one parse result can sit next to any byte owner (a memory
//! map, a `Vec`, a borrowed slice). Accessors return `Result` with the key in the error, so
//! model-loading code can use `?` and still tell the user exactly which key was missing or of
//! the wrong type; integer accessors accept any integer type whose value fits, because writers
//! disagree on whether e.g. `block_count` is u32, i32 or u64.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;

use super::value::{Array, Value};
use crate::error::{EngineError, Result};
use crate::quant::GgmlType;

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as in ggml: `[cols, rows]` for a matrix.
    pub dims: Vec<u64>,
    /// Element encoding.
    pub ty: GgmlType,
    /// Offset relative to the start of the data section.
    pub offset: u64,
    /// Product of `dims`.
    pub n_elements: u64,
    /// Size of the tensor's data in bytes.
    pub n_bytes: u64,
    /// Absolute start in the file (validated to lie inside it together with `n_bytes`).
    pub(crate) start: usize,
}

impl TensorInfo {
    /// Absolute byte range of the data in the file; always inside the parsed bytes.
    pub fn data_range(&self) -> Range<usize> {
        // Both fit in usize: the parser checked `start + n_bytes <= file length`.
        self.start..self.start + self.n_bytes as usize
    }
}

/// The parsed header, metadata and tensor table of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufIndex {
    pub(crate) version: u32,
    pub(crate) alignment: u32,
    pub(crate) data_offset: usize,
    pub(crate) metadata: Vec<(String, Value)>,
    pub(crate) meta_index: HashMap<String, usize>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) tensor_index: HashMap<String, usize>,
}

fn type_err(key: &str, expected: &'static str, found: String) -> EngineError {
    EngineError::MetadataType { key: key.to_string(), expected, found }
}

impl GgufIndex {
    /// Parses `bytes` (the whole file). Never panics; all problems are [`EngineError::Gguf`].
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        super::reader::parse(bytes)
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).and_then(|&i| self.metadata.get(i)).map(|(_, v)| v)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.meta_index.contains_key(key)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| EngineError::MissingMetadata(key.to_string()))
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            Value::String(s) => Ok(s),
            v => Err(type_err(key, "a string", v.describe())),
        }
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<T> {
        let v = self.require(key)?;
        let i = v.as_i128().ok_or_else(|| type_err(key, expected, v.describe()))?;
        T::try_from(i).map_err(|_| type_err(key, expected, format!("value {i}")))
    }

    /// An integer value that fits in u32 (stored as any integer type).
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.get_int(key, "an integer that fits in u32")
    }

    /// An integer value that fits in u64 (stored as any integer type).
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get_int(key, "an integer that fits in u64")
    }

    /// An integer value that fits in i64 (stored as any integer type).
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.get_int(key, "an integer that fits in i64")
    }

    /// A float value (f32, or f64 narrowed).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            Value::F32(f) => Ok(*f),
            Value::F64(f) => Ok(*f as f32),
            v => Err(type_err(key, "a float", v.describe())),
        }
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(type_err(key, "a bool", v.describe())),
        }
    }

    /// An array value of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array> {
        match self.require(key)? {
            Value::Array(a) => Ok(a),
            v => Err(type_err(key, "an array", v.describe())),
        }
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            a => {
                Err(type_err(key, "an array of string", format!("type array of {}", a.element_type().name())))
            }
        }
    }

    /// An array of integers that all fit in i32; borrowed when stored as i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Cow<'_, [i32]>> {
        const EXPECTED: &str = "an array of integers that fit in i32";
        let a = self.get_array(key)?;
        if let Array::I32(v) = a {
            return Ok(Cow::Borrowed(v));
        }
        let ints = a
            .integers()
            .ok_or_else(|| type_err(key, EXPECTED, format!("type array of {}", a.element_type().name())))?;
        ints.into_iter()
            .map(|i| i32::try_from(i).map_err(|_| type_err(key, EXPECTED, format!("element {i}"))))
            .collect::<Result<Vec<_>>>()
            .map(Cow::Owned)
    }

    /// An array of floats; borrowed when stored as f32, narrowed from f64 otherwise.
    pub fn get_f32_array(&self, key: &str) -> Result<Cow<'_, [f32]>> {
        match self.get_array(key)? {
            Array::F32(v) => Ok(Cow::Borrowed(v)),
            Array::F64(v) => Ok(Cow::Owned(v.iter().map(|&x| x as f32).collect())),
            a => {
                Err(type_err(key, "an array of float", format!("type array of {}", a.element_type().name())))
            }
        }
    }

    /// `general.architecture`, e.g. `"llama"`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// The tensor table in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's table entry.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).and_then(|&i| self.tensors.get(i))
    }
}
