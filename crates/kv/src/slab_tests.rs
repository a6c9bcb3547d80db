//! The SSD slab's tests: reopen, namespaces, torn and truncated files, LRU, and a proptest that
//! a load is the last store or nothing.
use super::*;
use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A slab file in the temp dir, removed when dropped.
struct TempSlab(PathBuf);

impl TempSlab {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        Self(std::env::temp_dir().join(format!("tokenpath-slab-{}-{n}", std::process::id())))
    }
}

impl Drop for TempSlab {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const G: SlabGeometry = SlabGeometry { slots: 4, payload_bytes: 5000 };

fn ns(name: &str) -> BlockHash {
    BlockHash::namespace(&[name.as_bytes(), b"f16"])
}

fn key(i: u32) -> BlockHash {
    crate::chain_hash(ns("keys"), &[i])
}

fn block(i: u32) -> Vec<u8> {
    (0..G.payload_bytes).map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8).collect()
}

#[test]
fn blocks_survive_a_reopen_and_other_namespaces_never_see_them() {
    let t = TempSlab::new();
    let (mut s, r) = Slab::open(&t.0, G, ns("model-a")).unwrap();
    assert_eq!(r, OpenReport { blocks: 0, torn: 4, foreign: 0 });
    assert_eq!(std::fs::metadata(&t.0).unwrap().len(), G.file_bytes());
    for i in 0..3 {
        s.put(key(i), &block(i)).unwrap();
    }
    s.sync().unwrap();
    drop(s);
    let (mut s, r) = Slab::open(&t.0, G, ns("model-a")).unwrap();
    assert_eq!((r.blocks, r.torn), (3, 1));
    for i in 0..3 {
        assert_eq!(s.get(&key(i)).unwrap(), Some(block(i)), "block {i} after the reopen");
    }
    assert_eq!(s.get(&key(9)).unwrap(), None);
    assert_eq!((s.stats().hits, s.stats().misses), (3, 1));
    drop(s);
    // Other weights: the same keys are not served, and their slots are free.
    let (mut s, r) = Slab::open(&t.0, G, ns("model-b")).unwrap();
    assert_eq!((r.blocks, r.foreign), (0, 3));
    assert_eq!(s.get(&key(0)).unwrap(), None);
    // Another geometry is refused, not reinterpreted.
    let other = SlabGeometry { slots: 5, ..G };
    assert!(matches!(Slab::open(&t.0, other, ns("model-a")), Err(KvError::SlabGeometry(_))));
}

#[test]
fn a_torn_payload_is_a_failed_load_never_a_hit() {
    let t = TempSlab::new();
    let (mut s, _) = Slab::open(&t.0, G, ns("m")).unwrap();
    s.put(key(1), &block(1)).unwrap();
    s.put(key(2), &block(2)).unwrap();
    // A crash that wrote a new payload but not its header (or a bit flip on disk).
    let f = OpenOptions::new().write(true).open(&t.0).unwrap();
    f.write_all_at(&[0xAA; 64], G.offset(0) + PAGE + 100).unwrap();
    assert_eq!(s.get(&key(1)).unwrap(), None);
    assert_eq!(s.stats().failed_loads, 1);
    assert!(!s.contains(&key(1)), "a block that failed is dropped");
    assert_eq!(s.get(&key(2)).unwrap(), Some(block(2)));
    // A torn header is dropped at open.
    f.write_all_at(&[0x55; 8], G.offset(1) + 40).unwrap();
    drop(s);
    let (mut s, r) = Slab::open(&t.0, G, ns("m")).unwrap();
    // Slot 0 cleared by the failed load, slot 1 torn, slots 2 and 3 never written.
    assert_eq!(r, OpenReport { blocks: 0, torn: 4, foreign: 0 });
    assert_eq!((s.get(&key(1)).unwrap(), s.get(&key(2)).unwrap()), (None, None));
    assert_eq!((s.stats().misses, s.stats().failed_loads), (2, 0));
}

/// A slab file cut short (a copy interrupted, a full disk): what is whole still loads, a block
/// whose payload was cut is a failed load, and nothing past the cut is served.
#[test]
fn a_truncated_slab_keeps_what_is_whole_and_never_serves_the_rest() {
    let t = TempSlab::new();
    let (mut s, _) = Slab::open(&t.0, G, ns("m")).unwrap();
    for i in 0..3 {
        s.put(key(i), &block(i)).unwrap();
    }
    drop(s);
    let f = OpenOptions::new().write(true).open(&t.0).unwrap();
    f.set_len(G.offset(1) + PAGE + 1000).unwrap();
    drop(f);
    let (mut s, r) = Slab::open(&t.0, G, ns("m")).unwrap();
    assert_eq!(std::fs::metadata(&t.0).unwrap().len(), G.file_bytes(), "grown back to its size");
    assert_eq!((r.blocks, r.torn), (2, 2), "two headers whole, the rest gone");
    assert_eq!(s.get(&key(0)).unwrap(), Some(block(0)));
    assert_eq!(s.get(&key(1)).unwrap(), None, "its payload was cut");
    assert_eq!(s.get(&key(2)).unwrap(), None);
    assert_eq!(s.stats().failed_loads, 1);
}

#[test]
fn the_least_recently_used_block_makes_room() {
    let t = TempSlab::new();
    let (mut s, _) = Slab::open(&t.0, G, ns("m")).unwrap();
    for i in 0..4 {
        assert_eq!(s.put(key(i), &block(i)).unwrap(), None);
    }
    s.get(&key(0)).unwrap();
    assert_eq!(s.put(key(4), &block(4)).unwrap(), Some(key(1)));
    assert_eq!(s.stats().evictions, 1);
    assert_eq!(s.len(), 4);
    assert!(s.remove(&key(2)).unwrap());
    assert!(!s.remove(&key(2)).unwrap());
    assert_eq!(s.put(key(5), &block(5)).unwrap(), None, "a removed block's slot is free");
    drop(s);
    let (mut s, r) = Slab::open(&t.0, G, ns("m")).unwrap();
    assert_eq!(r.blocks, 4);
    assert_eq!(s.get(&key(2)).unwrap(), None, "a removed block stays removed");
    assert!(matches!(s.put(key(6), &[0; 3]), Err(KvError::SlabGeometry(_))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Any sequence of stores, loads, removals and reopens: a load returns the last block
    /// stored under that key or nothing — never another key's bytes — and at most the
    /// slots' count of blocks is held.
    #[test]
    fn a_load_is_the_last_store_or_nothing(ops in proptest::collection::vec((0u8..4, 0u32..6, 0u32..50), 1..40)) {
        let t = TempSlab::new();
        let g = SlabGeometry { slots: 3, payload_bytes: 700 };
        let (mut s, _) = Slab::open(&t.0, g, ns("m")).unwrap();
        let mut last: HashMap<u32, u32> = HashMap::new();
        let bytes = |k: u32, v: u32| -> Vec<u8> { (0..700u32).map(|j| (j ^ (k * 13 + v * 101)) as u8).collect() };
        for (op, k, v) in ops {
            match op {
                0 => {
                    s.put(key(k), &bytes(k, v)).unwrap();
                    last.insert(k, v);
                }
                1 => {
                    if let Some(got) = s.get(&key(k)).unwrap() {
                        prop_assert_eq!(got, bytes(k, last[&k]));
                    }
                }
                2 => {
                    s.remove(&key(k)).unwrap();
                    last.remove(&k);
                }
                _ => {
                    drop(s);
                    s = Slab::open(&t.0, g, ns("m")).unwrap().0;
                }
            }
            prop_assert!(s.len() <= 3);
        }
    }
}
