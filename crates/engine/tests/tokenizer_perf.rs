//! Rough encode throughput on the default model (ignored by default; numbers from a debug
//! build are only indicative): `cargo test -p tokenpath-engine --test tokenizer_perf -- --ignored --nocapture`.

mod support;

use std::time::Instant;

#[test]
#[ignore]
fn encode_throughput() {
    let Some(l) = support::load_default() else { return };
    let raw = std::fs::read_to_string(support::fixture("tokenizer_corpus.json")).expect("corpus");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&raw).expect("json");
    let mut text = String::new();
    while text.len() < 1 << 20 {
        for c in &cases {
            text.push_str(c["text"].as_str().expect("text"));
            text.push(' ');
        }
    }
    for round in ["cold cache", "warm cache"] {
        let t = Instant::now();
        let ids = l.tok.encode(&text, false, true).expect("encode");
        let s = t.elapsed().as_secs_f64();
        eprintln!(
            "{round}: {} bytes -> {} tokens in {:.3} s = {:.1} MB/s, {:.0} tok/s",
            text.len(),
            ids.len(),
            s,
            text.len() as f64 / s / 1e6,
            ids.len() as f64 / s
        );
    }
    // Words that never repeat: no cache help.
    let unique: String = (0..100_000u32)
        .map(|i| {
            format!(
                "w{:x}q{} ",
                i.wrapping_mul(2_654_435_761),
                char::from_u32(0x4E00 + i % 20_000).unwrap_or('x')
            )
        })
        .collect();
    let t = Instant::now();
    let ids = l.tok.encode(&unique, false, false).expect("encode");
    let s = t.elapsed().as_secs_f64();
    eprintln!(
        "unique words: {} bytes -> {} tokens in {:.3} s = {:.1} MB/s",
        unique.len(),
        ids.len(),
        s,
        unique.len() as f64 / s / 1e6
    );
}
