//! A cache's blocks as little-endian wire bytes: exported for a transfer, imported or written
//! from one, and handed out for writing in place (the KV pool's loads).

use super::{BlockId, BlockTable, KvCache};
use crate::error::{EngineError, Result};
use half::f16;

impl KvCache {
    /// The raw bytes of blocks `from..to` of `table` (whole blocks), for moving KV to another
    /// engine instance. On a little-endian machine this is one memcpy per block.
    pub fn export_blocks(&self, table: &BlockTable, from: usize, to: usize) -> Vec<u8> {
        let to = to.min(table.blocks.len());
        let elems = self.layout.block_elems();
        let mut out = Vec::with_capacity(to.saturating_sub(from) * elems * 2);
        for &b in table.blocks.get(from..to).unwrap_or(&[]) {
            out.extend_from_slice(f16_bytes(self.block(b)).as_ref());
        }
        out
    }

    /// Copies block `b`'s raw bytes (as [`KvCache::export_blocks`] gives them) into `dst`;
    /// `false` when `dst` is not one block long or `b` is not a block of this cache.
    pub fn copy_block(&self, b: BlockId, dst: &mut [u8]) -> bool {
        if b.0 as usize >= self.total_blocks() || dst.len() != self.block_bytes() {
            return false;
        }
        dst.copy_from_slice(&f16_bytes(self.block(b)));
        true
    }

    /// The raw bytes of all blocks of `table` (the last one possibly partly filled).
    pub fn export(&self, table: &BlockTable) -> Vec<u8> {
        self.export_blocks(table, 0, table.blocks.len())
    }

    /// Blocks `first..first + n` of `table`, when they are all in it and none is lent out.
    fn writable<'t>(&self, table: &'t BlockTable, first: usize, n: usize) -> Result<&'t [BlockId]> {
        let Some(targets) = first.checked_add(n).and_then(|end| table.blocks.get(first..end)) else {
            return Err(EngineError::InvalidArgument(format!(
                "KV blocks {first}..{} are outside the sequence's {} blocks",
                first.saturating_add(n),
                table.blocks.len()
            )));
        };
        if let Some(b) = targets.iter().find(|b| self.is_leased(**b)) {
            return Err(EngineError::InvalidArgument(format!("block {} is leased", b.0)));
        }
        Ok(targets)
    }

    /// Writes whole blocks received from another engine into blocks `first..` of `table`, which
    /// must already be reserved. The byte count must be a whole number of blocks within the
    /// table; nothing from the wire is trusted.
    pub fn write_blocks(&mut self, table: &BlockTable, first: usize, bytes: &[u8]) -> Result<()> {
        let per_block = self.block_bytes();
        if !bytes.len().is_multiple_of(per_block) {
            return Err(EngineError::InvalidArgument(format!(
                "KV bytes ({}) are not a whole number of {per_block}-byte blocks",
                bytes.len()
            )));
        }
        let n = bytes.len() / per_block;
        let targets = self.writable(table, first, n)?;
        let elems = self.layout.block_elems();
        for (b, chunk) in targets.iter().zip(bytes.chunks_exact(per_block)) {
            let off = b.0 as usize * elems;
            // SAFETY: `&mut self`, and the block is not leased (checked above).
            let dst = unsafe { self.data.slice_mut(off, elems) };
            if cfg!(target_endian = "little") {
                bytemuck::cast_slice_mut::<f16, u8>(dst).copy_from_slice(chunk);
            } else {
                for (d, src) in dst.iter_mut().zip(chunk.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_le_bytes([src[0], src[1]]));
                }
            }
        }
        Ok(())
    }

    /// The memory of blocks `first..first + n` of `table` (reserved already), one byte slice of
    /// [`KvCache::block_bytes`] per block in [`KvCache::export_blocks`]'s format, for a caller
    /// that fills them straight from elsewhere (the KV pool copies its slots in, in parallel,
    /// instead of staging every block in a buffer first). Their contents count for nothing until
    /// [`KvCache::set_len`] covers them. Little-endian hosts only (an error elsewhere: use
    /// [`KvCache::write_blocks`]).
    pub fn blocks_bytes_mut(&mut self, table: &BlockTable, first: usize, n: usize) -> Result<Vec<&mut [u8]>> {
        if cfg!(target_endian = "big") {
            return Err(EngineError::InvalidArgument(
                "raw KV block access needs a little-endian host".into(),
            ));
        }
        let targets = self.writable(table, first, n)?;
        let mut seen = std::collections::HashSet::with_capacity(targets.len());
        if !targets.iter().all(|b| seen.insert(b.0)) {
            return Err(EngineError::InvalidArgument("a block twice in one table".into()));
        }
        // Only blocks this table alone holds: a shared block's bytes belong to others too.
        if let Some(b) = targets.iter().find(|b| self.refcount(**b) != 1) {
            return Err(EngineError::InvalidArgument(format!("block {} is shared", b.0)));
        }
        let elems = self.layout.block_elems();
        Ok(targets
            .iter()
            .map(|b| {
                // SAFETY: `&mut self` for the slices' lifetime, every block distinct (checked:
                // the slices never overlap) and none leased (checked above).
                let dst = unsafe { self.data.slice_mut(b.0 as usize * elems, elems) };
                bytemuck::cast_slice_mut::<f16, u8>(dst)
            })
            .collect())
    }

    /// Imports bytes produced by [`KvCache::export`] on an engine with the same layout as a new
    /// sequence of `n_tokens` tokens. All or nothing: on any error no block stays allocated.
    pub fn import(&mut self, bytes: &[u8], n_tokens: usize) -> Result<BlockTable> {
        let per_block = self.block_bytes();
        let n_blocks = n_tokens.div_ceil(self.layout.block_size);
        if bytes.len() != n_blocks * per_block {
            return Err(EngineError::InvalidArgument(format!(
                "KV import of {n_tokens} tokens needs {} bytes, got {}",
                n_blocks * per_block,
                bytes.len()
            )));
        }
        let mut table = BlockTable::default();
        self.reserve(&mut table, n_tokens)?;
        if let Err(e) = self.write_blocks(&table, 0, bytes) {
            let _ = self.free_table(&mut table);
            return Err(e);
        }
        table.len = n_tokens;
        Ok(table)
    }
}

/// The little-endian bytes of f16 values: borrowed where the machine is little-endian (the cast
/// is checked by `bytemuck`), converted otherwise.
fn f16_bytes(v: &[f16]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect())
    }
}
