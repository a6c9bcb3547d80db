//! Parser tests: writer → parser round trips, every rejection rule with a hand-built hostile
//! file, accessor semantics, and a seeded mutation run (thousands of corrupted and truncated
//! variants of a valid file) showing the parser never panics. The cargo-fuzz target in
//! `crates/engine/fuzz` runs the same `touch_everything` walk on arbitrary bytes.

use super::*;
use crate::quant::GgmlType;

/// A small model-like file with every metadata type, nested arrays and a few tensors.
fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "llama")
        .metadata("llama.block_count", 2u32)
        .metadata("u8", 7u8)
        .metadata("i8", -7i8)
        .metadata("u16", 700u16)
        .metadata("i16", -700i16)
        .metadata("i32", -70000i32)
        .metadata("f32", 1.5f32)
        .metadata("bool", true)
        .metadata("u64", 1u64 << 40)
        .metadata("i64", -(1i64 << 40))
        .metadata("f64", 2.25f64)
        .metadata("tokenizer.ggml.tokens", vec!["<s>", "a", "é", ""])
        .metadata("tokenizer.ggml.scores", vec![0.0f32, -1.0, -2.0, -3.0])
        .metadata("tokenizer.ggml.token_type", vec![3i32, 1, 1, 1])
        .metadata("small_ints", vec![1u8, 2, 3])
        .metadata("nested", Array::Array(vec![Array::U32(vec![1, 2]), Array::String(vec!["x".into()])]));
    let x = wave(64 * 3);
    w.tensor_f32("norm", &[64], GgmlType::F32, &x[..64]).unwrap();
    w.tensor_f32("w_q4_1", &[64, 3], GgmlType::Q4_1, &x).unwrap();
    w.tensor_f32("w_q8_0", &[64, 3], GgmlType::Q8_0, &x).unwrap();
    w.tensor_f32("w_f16", &[32, 2], GgmlType::F16, &x[..64]).unwrap();
    // A type the kernels do not implement: present, parseable, rejected only for compute.
    w.tensor("w_q5_k", &[256], GgmlType::Q5_K, vec![0u8; 176]).unwrap();
    w
}

/// Calls every accessor on every key and tensor; used by the mutation test and the fuzzer.
fn touch_everything(bytes: &[u8]) {
    let Ok(g) = Gguf::parse(bytes) else { return };
    let keys: Vec<String> = g.metadata().map(|(k, _)| k.to_string()).collect();
    for k in keys.iter().map(String::as_str).chain(["missing.key"]) {
        let _ = (g.get_str(k), g.get_u32(k), g.get_u64(k), g.get_i64(k), g.get_f32(k), g.get_bool(k));
        let _ = (g.get_str_array(k), g.get_i32_array(k), g.get_f32_array(k), g.get(k));
    }
    let _ = g.architecture();
    for t in g.tensor_views() {
        assert_eq!(t.data.len() as u64, t.ty.bytes_for(t.n_elements()).unwrap());
        if t.data.len() < 1 << 16 {
            if let Ok(v) = t.dequantize() {
                assert_eq!(v.len() as u64, t.n_elements());
            }
        }
        let _ = g.tensor(t.name).unwrap();
    }
}

#[test]
fn round_trip_every_value_type_v2_and_v3() {
    for version in [2, 3] {
        let mut w = sample_writer();
        w.version(version);
        let bytes = w.to_bytes();
        let g = Gguf::parse(bytes.as_slice()).unwrap();
        assert_eq!(g.version(), version);
        assert_eq!(g.alignment(), 32);
        assert_eq!(g.data_offset() % 32, 0);
        assert_eq!(g.architecture().unwrap(), "llama");
        assert_eq!(g.get("u8"), Some(&Value::U8(7)));
        assert_eq!(g.get("i8"), Some(&Value::I8(-7)));
        assert_eq!(g.get("u16"), Some(&Value::U16(700)));
        assert_eq!(g.get("i16"), Some(&Value::I16(-700)));
        assert_eq!(g.get("i32"), Some(&Value::I32(-70000)));
        assert_eq!(g.get_f32("f32").unwrap(), 1.5);
        assert!(g.get_bool("bool").unwrap());
        assert_eq!(g.get_u64("u64").unwrap(), 1 << 40);
        assert_eq!(g.get_i64("i64").unwrap(), -(1 << 40));
        assert_eq!(g.get_f32("f64").unwrap(), 2.25);
        assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), ["<s>", "a", "é", ""]);
        assert_eq!(&*g.get_f32_array("tokenizer.ggml.scores").unwrap(), [0.0, -1.0, -2.0, -3.0]);
        assert_eq!(&*g.get_i32_array("tokenizer.ggml.token_type").unwrap(), [3, 1, 1, 1]);
        assert_eq!(&*g.get_i32_array("small_ints").unwrap(), [1, 2, 3]);
        assert_eq!(
            g.get("nested"),
            Some(&Value::Array(Array::Array(vec![Array::U32(vec![1, 2]), Array::String(vec!["x".into()])])))
        );
        assert_eq!(g.metadata().count(), 17);
        assert_eq!(g.tensors().len(), 5);
        let t = g.tensor("w_q4_1").unwrap();
        assert_eq!((t.dims, t.ty), (&[64u64, 3][..], GgmlType::Q4_1));
        assert_eq!(t.matrix().unwrap().rows(), 3);
        let norm = g.tensor("norm").unwrap().dequantize().unwrap();
        assert_eq!(norm, wave(64 * 3)[..64]);
        for t in g.tensor_views() {
            assert_eq!(g.tensor_info(t.name).unwrap().offset % 32, 0);
        }
        touch_everything(&bytes);
    }
}

#[test]
fn custom_alignment_round_trips() {
    let mut w = sample_writer();
    w.alignment(64).unwrap();
    let bytes = w.to_bytes();
    let g = Gguf::parse(bytes).unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_offset() % 64, 0);
    assert!(g.tensors().iter().all(|t| t.offset % 64 == 0));
    assert_eq!(g.tensor("w_q8_0").unwrap().dequantize().unwrap().len(), 192);
}

#[test]
fn open_maps_a_file_from_disk() {
    let path = std::env::temp_dir().join(format!("tokenpath-gguf-open-{}.gguf", std::process::id()));
    sample_writer().write_to(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_u32("llama.block_count").unwrap(), 2);
    std::fs::remove_file(&path).unwrap();
    let err = GgufFile::open(&path).unwrap_err();
    assert!(matches!(err, EngineError::Io { .. }), "{err}");
}

#[test]
fn accessors_convert_fitting_integers_and_name_the_key() {
    let bytes = sample_writer().to_bytes();
    let g = Gguf::parse(&bytes[..]).unwrap();
    assert_eq!(g.get_u32("u8").unwrap(), 7);
    assert_eq!(g.get_u32("u16").unwrap(), 700);
    let e = g.get_u32("i8").unwrap_err().to_string();
    assert_eq!(e, "GGUF metadata key `i8` has value -7, expected an integer that fits in u32");
    let e = g.get_u32("u64").unwrap_err().to_string();
    assert!(e.contains("value 1099511627776"), "{e}");
    let e = g.get_u32("general.architecture").unwrap_err().to_string();
    assert_eq!(
        e,
        "GGUF metadata key `general.architecture` has type string, expected an integer that fits in u32"
    );
    assert_eq!(g.get_str("nope").unwrap_err().to_string(), "missing GGUF metadata key `nope`");
    let e = g.get_str_array("tokenizer.ggml.scores").unwrap_err().to_string();
    assert!(e.contains("type array of f32"), "{e}");
    assert!(g.get_f32_array("tokenizer.ggml.tokens").is_err());
    assert!(matches!(g.tensor("nope"), Err(EngineError::MissingTensor(_))));
}

#[test]
fn unsupported_tensor_type_fails_only_when_used() {
    let bytes = sample_writer().to_bytes();
    let g = Gguf::parse(&bytes[..]).unwrap();
    let t = g.tensor("w_q5_k").unwrap();
    assert_eq!(t.ty, GgmlType::Q5_K);
    assert_eq!(t.data.len(), 176);
    let e = t.matrix().unwrap_err().to_string();
    assert_eq!(
        e,
        "unsupported tensor type Q5_K for tensor `w_q5_k`; supported: F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K"
    );
    assert!(t.dequantize().is_err());
}

/// Hand-built headers for hostile inputs.
struct Raw(Vec<u8>);
impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut v = b"GGUF".to_vec();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&n_tensors.to_le_bytes());
        v.extend_from_slice(&n_kv.to_le_bytes());
        Raw(v)
    }
    fn u32(mut self, x: u32) -> Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn str(self, s: &str) -> Self {
        let mut r = self.u64(s.len() as u64);
        r.0.extend_from_slice(s.as_bytes());
        r
    }
    fn pad(mut self, n: usize) -> Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    fn err(&self) -> String {
        let e = GgufIndex::parse(&self.0).unwrap_err();
        assert!(matches!(e, EngineError::Gguf { .. }), "{e:?}");
        e.to_string()
    }
}

fn assert_contains(s: String, needle: &str) {
    assert!(s.contains(needle), "`{s}` does not contain `{needle}`");
}

#[test]
fn rejects_bad_headers() {
    assert_contains(Raw(b"GGML\x03\0\0\0".to_vec()).err(), "not a GGUF file");
    assert_contains(Raw(b"GG".to_vec()).err(), "unexpected end of file reading magic");
    assert_contains(Raw::header(1, 0, 0).err(), "version 1 is not supported");
    assert_contains(Raw::header(7, 0, 0).err(), "unsupported GGUF version 7");
    assert_contains(Raw::header(3u32.swap_bytes(), 0, 0).err(), "big-endian");
    assert!(GgufIndex::parse(&Raw::header(3, 0, 0).0).is_ok());
}

#[test]
fn huge_counts_fail_fast_without_allocating() {
    // 2^60 metadata entries / tensors / strings / array elements: each must be refused by the
    // bound check (an attempt to allocate would abort the test process).
    assert_contains(Raw::header(3, 0, 1 << 60).err(), "metadata count is 1152921504606846976");
    assert_contains(Raw::header(3, 1 << 60, 0).err(), "tensor count is 1152921504606846976");
    let r = Raw::header(3, 0, 1).str("k").u32(9).u32(8).u64(1 << 60);
    assert_contains(r.err(), "element count of metadata `k` is 1152921504606846976");
    let r = Raw::header(3, 0, 1).str("k").u32(9).u32(12).u64(u64::MAX);
    assert_contains(r.err(), "element count");
    let r = Raw::header(3, 0, 1).u64(u64::MAX - 3).pad(16);
    assert_contains(r.err(), "length of key of metadata entry 0");
    let r = Raw::header(3, 0, 1).str("k").u32(8).u64(1 << 40);
    assert_contains(r.err(), "length of metadata `k`");
}

#[test]
fn rejects_bad_metadata() {
    let r = Raw::header(3, 0, 1).str("k").u32(13).pad(8);
    assert_contains(r.err(), "unknown metadata value type 13");
    let r = Raw::header(3, 0, 2).str("k").u32(4).u32(1).str("k").u32(4).u32(2);
    assert_contains(r.err(), "duplicate metadata key `k`");
    let r = Raw::header(3, 0, 1).str("k").u32(8).u64(2);
    let mut r = r;
    r.0.extend_from_slice(&[0xff, 0xfe]);
    assert_contains(r.err(), "not valid UTF-8");
    let r = Raw::header(3, 0, 1).str("general.alignment").u32(4).u32(48);
    assert_contains(r.err(), "power of two");
    // Arrays nested 9 deep.
    let mut r = Raw::header(3, 0, 1).str("k").u32(9);
    for _ in 0..9 {
        r = r.u32(9).u64(1);
    }
    assert_contains(r.u32(4).u64(0).err(), "nested deeper");
}

fn one_tensor(name: &str, dims: &[u64], ty: u32, offset: u64) -> Raw {
    let mut r = Raw::header(3, 1, 0).str(name).u32(dims.len() as u32);
    for &d in dims {
        r = r.u64(d);
    }
    r.u32(ty).u64(offset)
}

#[test]
fn rejects_bad_tensor_infos() {
    assert_contains(one_tensor("t", &[1, 1, 1, 1, 1], 0, 0).err(), "5 dimensions");
    assert_contains(one_tensor("t", &[1 << 32, 1 << 32], 0, 0).pad(64).err(), "element count overflows");
    assert_contains(one_tensor("t", &[32], 4, 0).pad(64).err(), "unknown ggml type id 4");
    assert_contains(one_tensor("t", &[33], 2, 0).pad(64).err(), "not a multiple of the Q4_0 block size 32");
    assert_contains(one_tensor("t", &[8], 0, 3).pad(64).err(), "not a multiple of the alignment 32");
    // 8 f32 = 32 bytes, but the file ends right after the header padding.
    let r = one_tensor("t", &[8], 0, 0);
    let n = r.0.len().next_multiple_of(32) - r.0.len();
    assert_contains(r.pad(n + 31).err(), "extends past the end of the file");
    let r = one_tensor("t", &[8], 0, 1 << 62).pad(64);
    assert_contains(r.err(), "extends past the end of the file");
    let mut r = Raw::header(3, 2, 0);
    for _ in 0..2 {
        r = r.str("same").u32(1).u64(8).u32(0).u64(0);
    }
    assert_contains(r.pad(128).err(), "duplicate tensor name `same`");
}

#[test]
fn mutations_and_truncations_never_panic() {
    let base = sample_writer().to_bytes();
    let mut parsed_ok = 0;
    for b in crate::tiny::mutations(&base, base.len(), 4000, 0x9E37_79B9_7F4A_7C15) {
        if Gguf::parse(b.as_slice()).is_ok() {
            parsed_ok += 1;
        }
        touch_everything(&b);
    }
    // Sanity: some mutations (e.g. in tensor data or padding) still parse.
    assert!(parsed_ok > 100, "only {parsed_ok} mutated files parsed");
}

/// Test values; one out-of-line function so the writer's input and the expected output are the
/// same bits (two inlined copies of the loop may be vectorised differently at high opt-levels).
#[inline(never)]
fn wave(n: usize) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37).sin()).collect()
}
