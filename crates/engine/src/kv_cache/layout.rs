//! Where a value lives inside a block: the cache's shape ([`KvLayout`]) and the one place that
//! addresses a block's slabs — writing a token's K and V, and reading one KV head's keys and
//! values for attention. Apart from the allocator (`kv_cache.rs`) because the layout is what
//! attention's kernels and the wire fingerprint depend on, and the allocator is not.

use super::{BlockId, BlockTable, KvCache};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Shape of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub n_layer: usize,
    /// Width of one token's K (or V) in one layer (`kv heads × head_dim`).
    pub kv_dim: usize,
    /// Width of one KV head: the unit the block is laid out by.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl KvLayout {
    /// f16 elements of one (layer, K or V) slab of a block.
    fn slab(&self) -> usize {
        self.block_size * self.kv_dim
    }

    /// f16 elements of one whole block.
    pub fn block_elems(&self) -> usize {
        self.n_layer * 2 * self.slab()
    }

    /// Bytes of KV per token (all layers, K and V).
    pub fn bytes_per_token(&self) -> usize {
        self.n_layer * 2 * self.kv_dim * 2
    }

    /// Bytes of one whole block on the wire (f16, little-endian).
    pub fn block_bytes(&self) -> usize {
        self.block_elems() * 2
    }

    /// What two engines exchanging blocks must agree on for the bytes to mean the same thing:
    /// `n_layer`, `kv_dim`, `block_size`, `head_dim` (the block's layout depends on all four).
    pub fn fingerprint(&self) -> [u32; 4] {
        let n = |x: usize| u32::try_from(x).unwrap_or(u32::MAX);
        [n(self.n_layer), n(self.kv_dim), n(self.block_size), n(self.head_dim)]
    }
}

impl KvCache {
    fn slab_offset(&self, b: BlockId, layer: usize, v: bool) -> usize {
        let l = &self.layout;
        b.0 as usize * l.block_elems() + (layer * 2 + usize::from(v)) * l.slab()
    }

    /// Writes the K and V of token position `pos` of `table` in `layer`: keys dimension by
    /// dimension (`[kv_dim][block_size]`), values head by head (`[head][block_size][head_dim]`).
    pub(crate) fn write(&mut self, table: &BlockTable, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (bs, d, hd) = (self.layout.block_size, self.layout.kv_dim, self.layout.head_dim);
        assert!(k.len() == d && v.len() == d, "K/V row is not {d} values");
        let b = table.blocks[pos / bs];
        self.assert_not_leased(b);
        let slot = pos % bs;
        let (ko, vo) = (self.slab_offset(b, layer, false), self.slab_offset(b, layer, true));
        // SAFETY: `&mut self` excludes every other reference the cache made, and the block is
        // not leased, so no lease holds one either.
        let ks = unsafe { self.data.slice_mut(ko, bs * d) };
        // Converted a run at a time (`half`'s slice conversion: F16C eight values an instruction
        // where the CPU has it, the same rounding as `f16::from_f32` one by one), then placed
        // dimension by dimension. One value at a time, with `half`'s feature check per value,
        // was 2% of a 16-sequence decode step's samples, on the thread that runs it alone.
        const RUN: usize = 256;
        let mut run = [f16::ZERO; RUN];
        for (c, src) in k.chunks(RUN).enumerate() {
            let run = &mut run[..src.len()];
            run.convert_from_f32_slice(src);
            for (i, x) in run.iter().enumerate() {
                ks[(c * RUN + i) * bs + slot] = *x;
            }
        }
        // SAFETY: as above; the V slab does not overlap the K slab.
        let vs = unsafe { self.data.slice_mut(vo, bs * d) };
        for (h, src) in v.chunks_exact(hd).enumerate() {
            vs[(h * bs + slot) * hd..][..hd].convert_from_f32_slice(src);
        }
    }

    /// KV head `kvh`'s keys in block `b`, layer `layer`: `head_dim × block_size` values,
    /// dimension-major (`k[e · block_size + slot]`).
    pub(crate) fn k_head(&self, b: BlockId, layer: usize, kvh: usize) -> &[f16] {
        self.head(b, layer, kvh, false)
    }

    /// KV head `kvh`'s values in block `b`, layer `layer`: `block_size × head_dim` values,
    /// slot-major (`v[slot · head_dim + e]`).
    pub(crate) fn v_head(&self, b: BlockId, layer: usize, kvh: usize) -> &[f16] {
        self.head(b, layer, kvh, true)
    }

    fn head(&self, b: BlockId, layer: usize, kvh: usize, v: bool) -> &[f16] {
        self.assert_not_leased(b);
        let per_head = self.layout.head_dim * self.layout.block_size;
        assert!((kvh + 1) * per_head <= self.layout.slab(), "KV head {kvh} out of range");
        let off = self.slab_offset(b, layer, v) + kvh * per_head;
        // SAFETY: a shared borrow of the cache excludes its mutable references, and the block is
        // not leased.
        unsafe { self.data.slice(off, per_head) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_heads_keys_are_stored_by_dimension_and_its_values_by_slot() {
        // Small heads, and a K row longer than the 256 values `write` converts at a time.
        for (kv_dim, head_dim) in [(6, 3), (640, 128)] {
            let l = KvLayout { n_layer: 2, kv_dim, head_dim, block_size: 4 };
            let mut c = KvCache::new(l, 2).unwrap();
            let mut t = BlockTable::default();
            c.reserve(&mut t, 8).unwrap();
            // Distinct along a row and exact in f16 (halves below 1,024).
            let val = |pos: usize, layer: usize, j: usize| (pos * 13 + layer * 5 + j) as f32 * 0.5;
            for pos in 0..8 {
                for layer in 0..2 {
                    let k: Vec<f32> = (0..kv_dim).map(|j| val(pos, layer, j)).collect();
                    let v: Vec<f32> = k.iter().map(|x| -x).collect();
                    c.write(&t, layer, pos, &k, &v);
                }
            }
            let per_head = head_dim * 4;
            for pos in 0..8 {
                let (b, slot) = (t.blocks()[pos / 4], pos % 4);
                for layer in 0..2 {
                    for kvh in 0..kv_dim / head_dim {
                        let (k, v) = (c.k_head(b, layer, kvh), c.v_head(b, layer, kvh));
                        assert_eq!((k.len(), v.len()), (per_head, per_head));
                        for e in 0..head_dim {
                            let want = val(pos, layer, kvh * head_dim + e);
                            assert_eq!(k[e * 4 + slot].to_f32(), want, "K, position {pos}, head {kvh}, {e}");
                            assert_eq!(
                                v[slot * head_dim + e].to_f32(),
                                -want,
                                "V, position {pos}, head {kvh}, {e}"
                            );
                        }
                    }
                }
            }
        }
        let uneven = KvLayout { n_layer: 1, kv_dim: 6, head_dim: 4, block_size: 4 };
        assert!(KvCache::new(uneven, 1).is_err(), "kv_dim must be whole heads");
    }
}
