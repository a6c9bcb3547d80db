use super::*;
use crate::kv_cache::KvLayout;

/// A pseudo-random value in ±0.7.
fn val(i: usize) -> f32 {
    ((i * 2_654_435_761 % 1000) as f32 / 500.0 - 1.0) * 0.7
}

/// A one-layer cache of `n_kv` heads of `hd` values in blocks of `bs`, and a table holding `n`
/// positions of pseudo-random K and V.
fn filled(hd: usize, n_kv: usize, bs: usize, n: usize) -> (KvCache, BlockTable) {
    let layout = KvLayout { n_layer: 1, kv_dim: n_kv * hd, head_dim: hd, block_size: bs };
    let mut cache = KvCache::new(layout, n.div_ceil(bs)).unwrap();
    let mut table = BlockTable::default();
    cache.reserve(&mut table, n).unwrap();
    for pos in 0..n {
        let k: Vec<f32> = (0..n_kv * hd).map(|j| val(pos * 977 + j)).collect();
        let v: Vec<f32> = (0..n_kv * hd).map(|j| val(pos * 131 + j + 7)).collect();
        cache.write(&table, 0, pos, &k, &v);
    }
    cache.advance(&mut table, n);
    (cache, table)
}

#[test]
fn decode_attention_gives_the_same_bits_on_each_path_and_per_head() {
    // (head width, group, KV heads, block size): one, two, three and four query heads per
    // KV head (the AVX-512 kernel takes three at a time), whole and partial blocks of 16,
    // and block sizes that are no multiple of a vector.
    for (hd, group, n_kv, bs) in
        [(64, 3, 2, 16), (128, 4, 2, 16), (64, 2, 1, 8), (64, 1, 2, 5), (128, 3, 1, 32)]
    {
        let n = 300;
        let (cache, table) = filled(hd, n_kv, bs, n);
        let d = n_kv * group * hd;
        let rows = [(0, n - 1), (0, 140), (0, 15), (0, 0)];
        let q: Vec<f32> = (0..rows.len() * d).map(|j| val(j * 31 + 3)).collect();
        let job = |kvh, heads| Job {
            cache: &cache,
            table: &table,
            layer: 0,
            kvh,
            group,
            heads,
            hd,
            scale: 0.125,
            d,
            bf16: false,
        };
        for kvh in 0..n_kv {
            let whole = attend_decode(&job(kvh, 0..group), &rows, &q);
            for path in available_paths() {
                let got = attend_decode_path(&job(kvh, 0..group), &rows, &q, path);
                assert_eq!(
                    bits(&got),
                    bits(&whole),
                    "{path:?}, head width {hd}, group {group}, blocks of {bs}"
                );
                for g in 0..group {
                    let one = attend_decode_path(&job(kvh, g..g + 1), &rows, &q, path);
                    for r in 0..rows.len() {
                        assert_eq!(
                            bits(&one[r * hd..(r + 1) * hd]),
                            bits(&whole[(r * group + g) * hd..(r * group + g + 1) * hd]),
                            "{path:?}: head {g} alone, row {r}, head width {hd}, blocks of {bs}"
                        );
                    }
                }
            }
        }
    }
}

/// Query heads per KV head and values per row of [`prefill_chunk`]'s queries (64-value heads).
const CHUNK_GROUP: usize = 3;
const CHUNK_D: usize = CHUNK_GROUP * 64;

/// A cache and its table, `(sequence, position)` rows and their queries.
type Chunk = ((KvCache, BlockTable), Vec<(usize, usize)>, Vec<f32>);

/// A one-KV-head cache of `n` positions and one sequence's rows `first..n` with their queries: a
/// prefill chunk for the GEMM path.
fn prefill_chunk(first: usize, n: usize) -> Chunk {
    let rows: Vec<(usize, usize)> = (first..n).map(|p| (0, p)).collect();
    let q = (0..rows.len() * CHUNK_D).map(|j| val(j * 31 + 3)).collect();
    (filled(64, 1, 16, n), rows, q)
}

/// The task over every query head of [`prefill_chunk`]'s cache.
fn chunk_job<'a>(cache: &'a KvCache, table: &'a BlockTable) -> Job<'a> {
    let (group, hd) = (CHUNK_GROUP, 64);
    Job { cache, table, layer: 0, kvh: 0, group, heads: 0..group, hd, scale: 0.125, d: CHUNK_D, bf16: false }
}

#[test]
fn prefill_attention_reads_nothing_its_kept_buffers_held_before() {
    // The GEMM path keeps its buffers between tasks on a thread; every value it reads it must
    // have written in this task. Poisoned with NaN (and larger than needed, from a longer task),
    // the buffers must give the bits fresh ones give.
    let n = 100;
    let ((cache, table), rows, q) = prefill_chunk(60, n);
    let (job, d, group) = (chunk_job(&cache, &table), CHUNK_D, CHUNK_GROUP);
    assert!(rows.len() * group >= GEMM_MIN_ROWS, "the test must take the GEMM path");
    let fresh = attend_gemm_in(&job, &rows, &q, n, Path::best(), &mut Default::default());
    let mut poisoned: [Vec<f32>; 4] = std::array::from_fn(|_| vec![f32::NAN; 1 << 16]);
    let kept = attend_gemm_in(&job, &rows, &q, n, Path::best(), &mut poisoned);
    assert!(kept.iter().all(|x| x.is_finite()));
    assert_eq!(bits(&kept), bits(&fresh));
    // And through the thread's own buffers, after a longer task left them full.
    let _ = attend_task_gemm(&job, &rows, &q, n - 1);
    assert_eq!(
        bits(&attend_task_gemm(&job, &rows[..10], &q[..10 * d], 69)),
        bits(&attend_gemm_in(&job, &rows[..10], &q[..10 * d], 70, Path::best(), &mut Default::default()))
    );
}

#[test]
fn prefill_attention_gives_the_same_bits_on_each_path() {
    // Several score blocks and a ragged last one, from a prefix offset, on every path this CPU
    // runs (the products in `attention_gemm.rs`, the sum in `math::exp_shift_sum16`).
    let n = 2 * SUB + 45;
    let ((cache, table), rows, q) = prefill_chunk(20, n);
    let job = chunk_job(&cache, &table);
    let want = attend_gemm_in(&job, &rows, &q, n, Path::Portable, &mut Default::default());
    for path in available_paths() {
        let got = attend_gemm_in(&job, &rows, &q, n, path, &mut Default::default());
        assert_eq!(bits(&got), bits(&want), "{path:?}");
    }
}

/// The bf16 tiles (`attention_amx.rs`): close to the f32 products (bf16 keeps 8 bits of each
/// operand), not the same bits (so they ran), and a query row's output the same bits whether it
/// is computed among all the chunk's rows or in a task of its last eleven.
#[test]
fn prefill_attention_on_bf16_tiles_tracks_the_f32_products_and_a_row_keeps_its_bits() {
    if !super::super::attention_amx::usable(64) {
        eprintln!("skipped: no AMX-BF16 here");
        return;
    }
    let n = 2 * SUB + 45;
    let ((cache, table), rows, q) = prefill_chunk(20, n);
    let d = CHUNK_D;
    let f32s =
        attend_gemm_in(&chunk_job(&cache, &table), &rows, &q, n, Path::best(), &mut Default::default());
    let job = Job { bf16: true, ..chunk_job(&cache, &table) };
    let got = attend_gemm_in(&job, &rows, &q, n, Path::best(), &mut Default::default());
    assert_eq!(got.len(), f32s.len());
    let worst = got.iter().zip(&f32s).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    // Measured 7.7e-4 here; leaving the masked positions in makes it 2e-2.
    assert!(worst < 3e-3, "largest difference from the f32 products {worst}");
    assert_ne!(bits(&got), bits(&f32s), "the bf16 tiles ran");
    let first = rows.len() - 11;
    let tail =
        attend_gemm_in(&job, &rows[first..], &q[first * d..], n, Path::best(), &mut Default::default());
    assert_eq!(bits(&tail), bits(&got[first * d..]), "the last eleven rows alone");
}

#[test]
fn prefill_attention_in_score_blocks_matches_the_decode_path() {
    // Rows spanning several score blocks of `SUB` and a ragged last one, each block stopping at
    // its own last position: the GEMM path must agree with the decode path row by row.
    let n = 2 * SUB + 45;
    let ((cache, table), rows, q) = prefill_chunk(20, n);
    let (job, d) = (chunk_job(&cache, &table), CHUNK_D);
    let gemm = attend_task_gemm(&job, &rows, &q, n - 1);
    let decode = attend_decode(&job, &rows, &q);
    assert_eq!(gemm.len(), decode.len());
    for (i, (a, b)) in gemm.iter().zip(&decode).enumerate() {
        assert!((a - b).abs() < 1e-5, "value {i} (row {}): {a} against {b}", i / d);
    }
}

/// Decode attention as a batch-16 step at the serving benchmark's context runs it: sixteen
/// sequences at 720 positions, their blocks interleaved in the cache as growing sequences leave
/// them, SmolLM2-135M's heads (three KV heads of 64 values, three query heads each), every one of
/// 30 layers (265 MB of f16 K and V: memory) against layer 0 thirty times (8.8 MB: the cache).
/// Prints milliseconds a step and KV bytes read a second for both, alternating, on this CPU's
/// best path, for one, two and sixteen of the sequences.
///     cargo test --release -p tokenpath-engine --lib -- --ignored --nocapture decode_attention_throughput
#[test]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
fn decode_attention_throughput() {
    let (hd, group, n_kv, bs, n_layer, seqs, ctx) = (64, 3, 3, 16, 30, 16, 720);
    let layout = KvLayout { n_layer, kv_dim: n_kv * hd, head_dim: hd, block_size: bs };
    let mut cache = KvCache::new(layout, seqs * ctx / bs).unwrap();
    let mut tables: Vec<BlockTable> = (0..seqs).map(|_| BlockTable::default()).collect();
    for p0 in (0..ctx).step_by(bs) {
        for t in tables.iter_mut() {
            cache.reserve(t, p0 + bs).unwrap();
            for pos in p0..p0 + bs {
                for layer in 0..n_layer {
                    let k: Vec<f32> = (0..n_kv * hd).map(|j| val(pos * 977 + j + layer)).collect();
                    cache.write(t, layer, pos, &k, &k);
                }
            }
            cache.advance(t, bs);
        }
    }
    let token = [0u32];
    let d = n_kv * group * hd;
    let q: Vec<f32> = (0..seqs * d).map(|j| val(j * 31 + 3)).collect();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    // One, two and sixteen sequences: the first `n` tables.
    for n in [1, 2, seqs] {
        let rows: Vec<(usize, usize)> = (0..n).map(|i| (i, ctx - 1)).collect();
        let mut secs = [0f64; 2];
        for round in 0..6 {
            for (resident, total) in secs.iter_mut().enumerate() {
                let items: Vec<BatchItem<'_>> = tables[..n]
                    .iter_mut()
                    .map(|t| BatchItem { table: t, tokens: &token, all_logits: false })
                    .collect();
                let items = &items[..];
                let t = std::time::Instant::now();
                pool.install(|| {
                    crate::par::with_partner(|| {
                        for layer in 0..n_layer {
                            let layer = if resident == 1 { 0 } else { layer };
                            let out = attention(
                                &cache,
                                items,
                                &rows,
                                &q[..n * d],
                                layer,
                                n_kv * group,
                                group,
                                hd,
                                false,
                            );
                            std::hint::black_box(out);
                        }
                    })
                });
                if round > 0 {
                    *total += t.elapsed().as_secs_f64();
                }
            }
        }
        let kv_bytes = (n * ctx * n_kv * hd * 2 * 2 * n_layer) as f64;
        for (name, s) in ["30 layers (memory)", "layer 0 x 30 (cache)"].iter().zip(secs) {
            let step = s / 5.0;
            println!(
                "{:?}, {n} sequences, {name}: {:.2} ms a step, {:.1} GB/s of K and V",
                Path::best(),
                step * 1e3,
                kv_bytes / step / 1e9
            );
        }
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
