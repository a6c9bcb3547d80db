//! The forward pass against a plain dense reference, and the batching invariants the serving path
//! relies on: a batch gives each sequence the logits it would get alone, chunked prefill equals
//! whole prefill, exported KV continues identically in another cache, and errors leak nothing.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod support;

use tokenpath_engine::kv_cache::{BlockTable, KvCache};
use tokenpath_engine::model::{BatchItem, Model, Numerics};
use tokenpath_engine::quant::GgmlType;
use tokenpath_engine::tiny::{tiny_model_bytes, TinySpec};
use tokenpath_engine::EngineError;

fn tiny(ty: GgmlType) -> Model {
    Model::from_bytes(tiny_model_bytes(&TinySpec { ty, ..TinySpec::default() }).unwrap()).unwrap()
}

fn cache(m: &Model, blocks: usize) -> KvCache {
    let c = m.config();
    KvCache::new(
        tokenpath_engine::kv_cache::KvLayout {
            n_layer: c.n_layer,
            kv_dim: c.kv_dim(),
            head_dim: c.head_dim,
            block_size: 4,
        },
        blocks,
    )
    .unwrap()
}

fn run(m: &Model, kv: &mut KvCache, t: &mut BlockTable, tokens: &[u32], all: bool) -> Vec<f32> {
    let mut b = [BatchItem { table: t, tokens, all_logits: all }];
    m.forward(kv, &mut b).unwrap().into_first()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn forward_matches_dense_reference() {
    let m = tiny(GgmlType::F32);
    // 13 tokens run through the integer matvec kernels, 45 through the dequantize + GEMM path;
    // both span several KV blocks.
    for n in [13, 45] {
        let tokens: Vec<u32> = (0..n).map(|i| (i * 37 + 5) % m.config().n_vocab as u32).collect();
        let mut kv = cache(&m, 16);
        let mut t = BlockTable::default();
        let ours = run(&m, &mut kv, &mut t, &tokens, false);
        let bytes = tiny_model_bytes(&TinySpec::default()).unwrap(); // the F32 file `m` was loaded from
        let want = support::reference_logits(
            &tokenpath_engine::gguf::Gguf::parse(bytes).unwrap(),
            m.config(),
            &tokens,
        );
        let diff = max_diff(&ours, &want);
        assert!(diff < 1e-3, "{n} tokens: max logit difference {diff}");
    }
}

#[test]
fn chunked_prefill_equals_whole_prefill_and_decode_matches_all_logits() {
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_1] {
        let m = tiny(ty);
        let tokens: Vec<u32> = (0..11).map(|i| (i * 11 + 3) % 200).collect();
        let mut kv = cache(&m, 32);
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        let whole = run(&m, &mut kv, &mut a, &tokens, true);
        let mut last = Vec::new();
        for piece in tokens.chunks(3) {
            last = run(&m, &mut kv, &mut b, piece, false);
        }
        let n_vocab = m.config().n_vocab;
        // Invariant 12: pieces of three rows give the whole prompt's bits.
        assert_eq!(&whole[10 * n_vocab..], &last[..], "{ty:?}");
        assert_eq!(a.len(), 11);
        kv.free_table(&mut a).unwrap();
        kv.free_table(&mut b).unwrap();
        assert_eq!(kv.used_blocks(), 0);
    }
}

/// Invariant 12 under the bf16 prompt products: a prompt's last logits have the same bits whole
/// or in chunks of two or more rows (a bf16 product's row does not depend on the rows beside it),
/// and under `Numerics::Invariant` in chunks of any size. Where the model made bf16 copies the two
/// numerics give different bits — so the `Fast` half did run the bf16 tiles.
#[test]
fn a_prompt_has_the_same_bits_whole_or_chunked_under_either_numerics() {
    use tokenpath_engine::quant::{amx_bf16, Kernel};
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1] {
        let tokens: Vec<u32> = (0..11).map(|i| (i * 13 + 5) % 200).collect();
        let mut last = Vec::new();
        for (numerics, chunks) in [(Numerics::Fast, [2, 4, 5]), (Numerics::Invariant, [1, 3, 7])] {
            let mut m = tiny(ty);
            m.set_numerics(numerics).unwrap();
            let mut kv = cache(&m, 32);
            let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
            let whole = run(&m, &mut kv, &mut a, &tokens, false);
            let mut got = Vec::new();
            let mut at = 0;
            for n in chunks {
                got = run(&m, &mut kv, &mut b, &tokens[at..at + n], false);
                at += n;
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&whole), bits(&got), "{ty:?} {numerics:?} in chunks of {chunks:?}");
            last.push(bits(&whole));
        }
        let bf16 = amx_bf16::available() && Kernel::best() >= Kernel::Amx;
        assert_eq!(last[0] != last[1], bf16, "{ty:?}: Fast and Invariant differ only on the bf16 tiles");
    }
}

/// Chunks of every size after a prefix, against the dense reference: a last chunk of 1, 5 or 31
/// rows after 32 cached tokens (what a prefix-cache hit or `--prefill-chunk 32` runs) gives the
/// logits a whole prefill does, on both sides of attention's 32-row switch.
#[test]
fn a_short_chunk_after_a_long_prefix_matches_the_reference() {
    let m = tiny(GgmlType::F32);
    let bytes = tiny_model_bytes(&TinySpec::default()).unwrap();
    let gguf = tokenpath_engine::gguf::Gguf::parse(bytes).unwrap();
    for (prefix, rest) in [(32usize, 5usize), (32, 1), (8, 29), (33, 31), (40, 2)] {
        let tokens: Vec<u32> =
            (0..prefix + rest).map(|i| (i as u32 * 29 + 7) % m.config().n_vocab as u32).collect();
        let want = support::reference_logits(&gguf, m.config(), &tokens);
        let mut kv = cache(&m, 64);
        let mut t = BlockTable::default();
        run(&m, &mut kv, &mut t, &tokens[..prefix], false);
        let got = run(&m, &mut kv, &mut t, &tokens[prefix..], false);
        let diff = max_diff(&got, &want);
        assert!(diff < 1e-3, "{prefix} + {rest} tokens: max logit difference {diff}");
        kv.free_table(&mut t).unwrap();
    }
}

#[test]
fn a_batch_gives_each_sequence_its_solo_logits() {
    let m = tiny(GgmlType::Q8_0);
    let mut kv = cache(&m, 64);
    let prompts: [&[u32]; 3] = [&[5, 6, 7, 8, 9], &[100, 3], &[42, 43, 44, 45, 46, 47, 48, 49, 50]];
    // Solo: prefill then one decode step each.
    let mut solo = Vec::new();
    for p in prompts {
        let mut t = BlockTable::default();
        run(&m, &mut kv, &mut t, p, false);
        solo.push(run(&m, &mut kv, &mut t, &[77], false));
        kv.free_table(&mut t).unwrap();
    }
    // Batched: prefill all three together, then decode all three together.
    let mut tables = [BlockTable::default(), BlockTable::default(), BlockTable::default()];
    {
        let mut batch: Vec<BatchItem<'_>> = tables
            .iter_mut()
            .zip(prompts)
            .map(|(table, tokens)| BatchItem { table, tokens, all_logits: false })
            .collect();
        m.forward(&mut kv, &mut batch).unwrap();
    }
    let step: Vec<Vec<f32>> = {
        let mut batch: Vec<BatchItem<'_>> =
            tables.iter_mut().map(|table| BatchItem { table, tokens: &[77], all_logits: false }).collect();
        m.forward(&mut kv, &mut batch).unwrap().into_items()
    };
    // Invariant 12: a batch gives each sequence the bits it gets alone.
    for (i, (a, b)) in solo.iter().zip(&step).enumerate() {
        assert_eq!(a, b, "sequence {i}");
    }
}

#[test]
fn every_decode_batch_size_gives_each_sequence_its_solo_bits() {
    // Decode steps of 1 to 63 rows run on the calling thread and the pool's spinning partner
    // (`crate::par`), from 64 on rayon's pool; a sequence's logits are the same bits whichever,
    // and whatever the batch (invariant 12, Q4_1 repacked).
    let m = tiny(GgmlType::Q4_1);
    let mut kv = cache(&m, 1024);
    let prompt =
        |i: usize| -> Vec<u32> { (0..3 + i % 5).map(|j| (i * 31 + j * 7 + 1) as u32 % 200).collect() };
    let solo: Vec<Vec<f32>> = (0..70)
        .map(|i| {
            let mut t = BlockTable::default();
            run(&m, &mut kv, &mut t, &prompt(i), false);
            let got = run(&m, &mut kv, &mut t, &[77], false);
            kv.free_table(&mut t).unwrap();
            got
        })
        .collect();
    // A 40-token prompt alone (the tiny model's output matrix is not repacked: an item of 32 or
    // more rows takes dequantize + GEMM for it).
    let long: Vec<u32> = (0..40).map(|j| (j * 13 + 5) % 200).collect();
    let long_solo = {
        let mut t = BlockTable::default();
        let got = run(&m, &mut kv, &mut t, &long, true);
        kv.free_table(&mut t).unwrap();
        got
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Decode steps of n sequences, alone and beside that prompt.
    for (n, with_long) in
        [(2, false), (16, false), (20, false), (63, false), (64, false), (70, false), (20, true)]
    {
        let mut tables: Vec<BlockTable> = (0..n).map(|_| BlockTable::default()).collect();
        for (i, t) in tables.iter_mut().enumerate() {
            run(&m, &mut kv, t, &prompt(i), false);
        }
        let mut long_table = BlockTable::default();
        let step = {
            let mut batch: Vec<BatchItem<'_>> = tables
                .iter_mut()
                .map(|table| BatchItem { table, tokens: &[77], all_logits: false })
                .collect();
            if with_long {
                batch.insert(n / 2, BatchItem { table: &mut long_table, tokens: &long, all_logits: true });
            }
            m.forward(&mut kv, &mut batch).unwrap().into_items()
        };
        let mut step = step.into_iter();
        for (i, want) in solo.iter().enumerate().take(n) {
            if with_long && i == n / 2 {
                assert_eq!(bits(&step.next().unwrap()), bits(&long_solo), "the prompt beside {n} decodes");
            }
            assert_eq!(bits(&step.next().unwrap()), bits(want), "sequence {i} of a decode step of {n}");
        }
        for t in tables.iter_mut().chain([&mut long_table]) {
            kv.free_table(t).unwrap();
        }
    }
    assert_eq!(kv.used_blocks(), 0);
}

#[test]
fn exported_kv_continues_identically_in_another_cache() {
    let m = tiny(GgmlType::Q4_1);
    let prompt: Vec<u32> = (10..27).collect();
    let mut a = cache(&m, 16);
    let mut ta = BlockTable::default();
    run(&m, &mut a, &mut ta, &prompt, false);
    let bytes = a.export(&ta);
    let want = run(&m, &mut a, &mut ta, &[9], false);
    let mut b = cache(&m, 16);
    let mut tb = b.import(&bytes, prompt.len()).unwrap();
    let got = run(&m, &mut b, &mut tb, &[9], false);
    assert_eq!(got, want);
}

#[test]
fn errors_leave_no_block_behind() {
    let m = tiny(GgmlType::F32);
    let mut kv = cache(&m, 3); // 12 tokens
    let mut t = BlockTable::default();
    let mut batch = [BatchItem { table: &mut t, tokens: &[1; 13], all_logits: false }];
    assert!(matches!(m.forward(&mut kv, &mut batch), Err(EngineError::KvCacheFull { .. })));
    assert_eq!((kv.used_blocks(), t.len(), t.blocks().len()), (0, 0, 0));

    let mut t2 = BlockTable::default();
    let mut u = BlockTable::default();
    let mut batch = [
        BatchItem { table: &mut t2, tokens: &[1, 2, 3], all_logits: false },
        BatchItem { table: &mut u, tokens: &[1, 999_999], all_logits: false },
    ];
    let err = m.forward(&mut kv, &mut batch).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    assert_eq!(kv.used_blocks(), 0);

    let mut big = cache(&m, 128);
    let mut t3 = BlockTable::default();
    let long = vec![1u32; m.config().n_ctx + 1];
    let mut batch = [BatchItem { table: &mut t3, tokens: &long, all_logits: false }];
    assert!(matches!(m.forward(&mut big, &mut batch), Err(EngineError::ContextOverflow { .. })));
    assert_eq!(big.used_blocks(), 0);
}

/// `Numerics::Ggml` on models the test writes (the bit-exact check against llama.cpp itself is
/// `llama_cpp_parity.rs`, on the real model): it tracks the fast pass to quantization noise for
/// a prompt and its decode steps, depends on the batch only as llama.cpp does (a prompt split
/// into chunks of ≥ 2 tokens gives the whole prompt's logits exactly), leaves no block behind,
/// and refuses a type it does not reproduce.
#[test]
fn ggml_numerics_track_the_fast_pass_and_refuse_other_types() {
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let fast = tiny(ty);
        let mut exact = tiny(ty);
        exact.set_numerics(Numerics::Ggml).unwrap();
        assert_eq!(exact.numerics(), Numerics::Ggml);
        let tokens: Vec<u32> = (0..21).map(|i| (i * 31 + 3) % fast.config().n_vocab as u32).collect();
        let (mut kf, mut ke) = (cache(&fast, 16), cache(&exact, 16));
        let (mut tf, mut te) = (BlockTable::default(), BlockTable::default());
        let a = run(&fast, &mut kf, &mut tf, &tokens, false);
        let b = run(&exact, &mut ke, &mut te, &tokens, false);
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max_diff(&a, &b) < 0.05 * scale, "{ty:?}: prefill {} vs scale {scale}", max_diff(&a, &b));
        for step in [7u32, 11, 13] {
            let a = run(&fast, &mut kf, &mut tf, &[step], false);
            let b = run(&exact, &mut ke, &mut te, &[step], false);
            assert!(max_diff(&a, &b) < 0.05 * scale, "{ty:?}: decode {}", max_diff(&a, &b));
        }
        // Chunks of at least two tokens take the same (batched) products as the whole prompt.
        let mut kc = cache(&exact, 16);
        let mut tc = BlockTable::default();
        run(&exact, &mut kc, &mut tc, &tokens[..9], false);
        let chunked = run(&exact, &mut kc, &mut tc, &tokens[9..], false);
        let mut kw = cache(&exact, 16);
        let mut tw = BlockTable::default();
        let whole = run(&exact, &mut kw, &mut tw, &tokens, false);
        assert_eq!(chunked, whole, "{ty:?}");
        for (kv, t) in [(&mut kf, &mut tf), (&mut ke, &mut te), (&mut kc, &mut tc), (&mut kw, &mut tw)] {
            kv.free_table(t).unwrap();
            assert_eq!(kv.used_blocks(), 0);
        }
    }
    let mut f32_model = tiny(GgmlType::F32);
    let err = f32_model.set_numerics(Numerics::Ggml).unwrap_err().to_string();
    assert!(err.contains("Q4_1 and Q8_0"), "{err}");
    assert_eq!(f32_model.numerics(), Numerics::Fast);
}
