use super::ForwardOutput;
use crate::kv_cache::{BlockTable, KvCache, KvLayout};
use crate::model::{BatchItem, Model};
use crate::tiny::{tiny_model_bytes, TinySpec};

/// Invariant 11 for a failure inside the pass (regression: blocks reserved for a call that
/// failed after the reservation stayed in its tables, and the tables had already advanced).
#[test]
fn a_pass_that_fails_after_its_layers_leaves_the_tables_and_the_free_blocks_as_they_were() {
    let m = Model::from_bytes(tiny_model_bytes(&TinySpec::default()).unwrap()).unwrap();
    let c = m.config();
    let layout = KvLayout { n_layer: c.n_layer, kv_dim: c.kv_dim(), head_dim: c.head_dim, block_size: 4 };
    let mut kv = KvCache::new(layout, 16).unwrap();
    let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
    m.forward(&mut kv, &mut [BatchItem { table: &mut a, tokens: &[1, 2, 3, 4, 5], all_logits: false }])
        .unwrap();
    let (used, len, blocks) = (kv.used_blocks(), a.len(), a.blocks().to_vec());
    let mut step = |t: &mut BlockTable, tokens: &[u32]| {
        m.forward(&mut kv, &mut [BatchItem { table: t, tokens, all_logits: false }]).unwrap().into_first()
    };
    step(&mut b, &[1, 2, 3, 4, 5]);
    let want = step(&mut b, &[6]);
    kv.free_table(&mut b).unwrap();

    m.fail_at_the_head.store(true, std::sync::atomic::Ordering::Relaxed);
    let failed = m.forward(
        &mut kv,
        &mut [
            BatchItem { table: &mut a, tokens: &[7, 8, 9, 10, 11], all_logits: false },
            BatchItem { table: &mut b, tokens: &[3; 9], all_logits: false },
        ],
    );
    m.fail_at_the_head.store(false, std::sync::atomic::Ordering::Relaxed);
    assert!(failed.is_err());
    assert_eq!((kv.used_blocks(), a.len(), a.blocks()), (used, len, &blocks[..]));
    assert_eq!((b.len(), b.blocks().len()), (0, 0));
    // The sequence goes on as if the failed call had never been made.
    let got =
        m.forward(&mut kv, &mut [BatchItem { table: &mut a, tokens: &[6], all_logits: false }]).unwrap();
    assert_eq!(got.into_first(), want);
}

#[test]
fn each_item_gets_its_own_rows_of_the_one_buffer() {
    let logits: Vec<f32> = (0..12).map(|x| x as f32).collect();
    let mut out = ForwardOutput { logits, ends: vec![3, 9, 12] };
    assert_eq!((out.len(), out.item(1)), (3, &[3.0, 4.0, 5.0, 6.0, 7.0, 8.0][..]));
    let mut items = out.items_mut();
    assert_eq!(items.iter().map(|i| i.len()).collect::<Vec<_>>(), [3, 6, 3]);
    items[2][0] = -1.0;
    assert_eq!(out.item(2), &[-1.0, 10.0, 11.0]);
    assert_eq!(out.clone().into_items()[0], [0.0, 1.0, 2.0]);
    assert_eq!(out.into_first(), [0.0, 1.0, 2.0]);
}
