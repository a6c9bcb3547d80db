//! Fuzz target: arbitrary bytes into the GGUF parser, then every accessor on every key and
//! tensor. The parser must return errors, never panic, never allocate beyond what the input can
//! justify (libFuzzer's -rss_limit_mb catches that), and every tensor view it hands out must be
//! exactly as long as its type and shape say. The stable unit test
//! `gguf::tests::mutations_and_truncations_never_panic` runs the same walk on seeded mutations.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokenpath_engine::gguf::Gguf;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::parse(data) else { return };
    let keys: Vec<String> = g.metadata().map(|(k, _)| k.to_string()).collect();
    for k in keys.iter().map(String::as_str).chain(["missing.key"]) {
        let _ = (g.get_str(k), g.get_u32(k), g.get_u64(k), g.get_i64(k), g.get_f32(k), g.get_bool(k));
        let _ = (g.get_str_array(k), g.get_i32_array(k), g.get_f32_array(k), g.get(k), g.get_array(k));
    }
    let _ = g.architecture();
    for t in g.tensor_views() {
        assert_eq!(Some(t.data.len() as u64), t.ty.bytes_for(t.n_elements()));
        assert!(g.tensor(t.name).is_ok());
        if t.data.len() < 1 << 16 {
            if let Ok(m) = t.matrix() {
                let v = m.dequantize().expect("supported matrix dequantizes");
                assert_eq!(v.len() as u64, t.n_elements());
                // A zero-row tensor may still claim a huge width; only run what fits in memory.
                if m.cols() > 1 << 16 || m.rows() > 1 << 16 {
                    continue;
                }
                let x = vec![0.5f32; m.cols()];
                let mut y = vec![0f32; m.rows()];
                // Columns may not be a whole number of activation blocks; that is an error, not a panic.
                let _ = m.matvec(&x, &mut y);
            }
        }
    }
});
