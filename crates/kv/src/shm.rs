//! Sealed shared memory on one host: the memfd behind the same-host KV transfer ring (worker
//! crate) and behind the KV pool's RAM tier ([`crate::pool`]), and [`SharedSlots`], a mapping of
//! fixed-size slots touched only through bounds-checked copies.
//!
//! Why copies only: the memory changes under a reader (the owner writing other slots; a ring's
//! peer), so no reference into it is ever handed out (a `&[u8]` into memory another process
//! changes is undefined behaviour). A pool's RAM tier is writable by its owner alone: the owner
//! maps it, then seals it with `F_SEAL_FUTURE_WRITE`, after which no process — a client holding
//! the descriptor included — can map it writable or `write` it; clients map it read-only. What a
//! client copies out is still checked against the check the owner keeps.
//!
//! Linux only (memfd seals); elsewhere creating one fails and callers run without it.

use std::fs::File;
use std::io;

/// A new memfd of `len` bytes, sealed against shrinking and growing (a shrunk mapping would
/// fault in every process that maps it).
pub fn sealed_memfd(len: usize) -> io::Result<File> {
    sys::sealed_memfd(len)
}

/// Whether a passed descriptor is sealed against shrinking (checked before mapping one).
pub fn sealed_against_shrinking(file: &File) -> io::Result<bool> {
    sys::sealed_against_shrinking(file)
}

/// `memcpy`, except when the destination sits just past the source modulo 4 KiB (a page-aligned
/// ring into a heap buffer 16 bytes into its page, the common case): there `rep movsb`, which the
/// C library uses for copies of a few KiB and more, runs at a fraction of memory speed on some
/// x86 cores (4K aliasing: every store looks like it may feed the next load). Copies of 2 KiB
/// take the C library's vector loop instead, at full speed: 11 ms for 94 MB here, against 52 ms.
///
/// # Safety
/// As `ptr::copy_nonoverlapping(src, dst, len)`.
pub unsafe fn copy_unaliased(dst: *mut u8, src: *const u8, len: usize) {
    const SMALL: usize = 2048;
    let distance = (dst as usize).wrapping_sub(src as usize) % 4096;
    if distance == 0 || distance >= 64 {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        return;
    }
    let mut done = 0;
    while done < len {
        let n = SMALL.min(len - done);
        // SAFETY: `done + n <= len`, inside both ranges the caller vouched for.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n) };
        done += n;
    }
}

/// A mapping of `slots` slots of `slot_bytes` each.
#[derive(Debug)]
pub struct SharedSlots {
    map: memmap2::MmapRaw,
    slot_bytes: usize,
    slots: u32,
    /// The owner's mapping; a client's is read-only.
    writable: bool,
}

impl SharedSlots {
    /// A fresh sealed memfd of the slots, and its mapping — the owner's, the only writable one:
    /// the memfd is sealed against any other write once it is mapped here.
    pub fn create(slots: u32, slot_bytes: usize) -> io::Result<(File, Self)> {
        let len = (slots as usize)
            .checked_mul(slot_bytes)
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::other(format!("{slots} slots of {slot_bytes} bytes")))?;
        let file = sys::memfd(len)?;
        let me = Self::map(&file, slots, slot_bytes, true)?;
        sys::seal_future_writes(&file)?;
        Ok((file, me))
    }

    /// Maps a passed memfd read-only after checking it is sealed (against resizing and against
    /// writes but its owner's) and exactly `slots × slot_bytes` long.
    pub fn open(file: &File, slots: u32, slot_bytes: usize) -> io::Result<Self> {
        let len = (slots as usize).checked_mul(slot_bytes).filter(|&l| l > 0 && l <= 1 << 40);
        let len = len.ok_or_else(|| io::Error::other(format!("{slots} slots of {slot_bytes} bytes")))?;
        if file.metadata()?.len() != len as u64 || !sys::sealed_for_readers(file)? {
            return Err(io::Error::other("the pool's memory is not a sealed memfd of its size"));
        }
        Self::map(file, slots, slot_bytes, false)
    }

    /// Mapped with its pages faulted in at once (`MAP_POPULATE`): the tier's memory is committed
    /// when the pool starts, not one fault per page on a load's critical path (a 4,096-token
    /// prefix of the default model is 23,000 pages).
    fn map(file: &File, slots: u32, slot_bytes: usize, writable: bool) -> io::Result<Self> {
        let mut opts = memmap2::MmapOptions::new();
        opts.len(slots as usize * slot_bytes).populate();
        let map = if writable { opts.map_raw(file)? } else { opts.map_raw_read_only(file)? };
        Ok(Self { map, slot_bytes, slots, writable })
    }

    /// Slots in the mapping.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn start(&self, slot: u32, len: usize) -> Result<usize, String> {
        if slot >= self.slots || len > self.slot_bytes {
            return Err(format!("{len} bytes at slot {slot} of {} × {}", self.slots, self.slot_bytes));
        }
        Ok(slot as usize * self.slot_bytes)
    }

    /// Copies the first `dst.len()` bytes of `slot` out.
    pub fn copy_out(&self, slot: u32, dst: &mut [u8]) -> Result<(), String> {
        let start = self.start(slot, dst.len())?;
        // SAFETY: `start..start + dst.len()` lies inside the mapping (checked against the slot
        // count and size it was created or opened with), which lives as long as `self` and
        // cannot shrink (sealed). Another process may write it meanwhile: the copy is then
        // garbage, which the caller's checksum rejects.
        unsafe { copy_unaliased(dst.as_mut_ptr(), self.map.as_ptr().add(start), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the start of `slot` (the owner's mapping only).
    pub fn copy_in(&self, slot: u32, src: &[u8]) -> Result<(), String> {
        if !self.writable {
            return Err("a client's mapping of the pool is read-only".into());
        }
        let start = self.start(slot, src.len())?;
        // SAFETY: inside the mapping (checked), which cannot shrink; `src` is the caller's memory.
        unsafe { copy_unaliased(self.map.as_mut_ptr().add(start), src.as_ptr(), src.len()) };
        Ok(())
    }
}

#[cfg(target_os = "linux")]
mod sys {
    use std::fs::File;
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd};

    const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

    pub(super) fn sealed_memfd(len: usize) -> io::Result<File> {
        let file = memfd(len)?;
        add_seals(&file, SEALS)?;
        Ok(file)
    }

    /// A memfd of `len` bytes with no seal yet (sealing allowed).
    pub(super) fn memfd(len: usize) -> io::Result<File> {
        // SAFETY: a valid NUL-terminated name and flags; the returned descriptor is checked.
        let fd = unsafe {
            libc::memfd_create(c"tokenpath-kv".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64)?;
        Ok(file)
    }

    fn add_seals(file: &File, seals: libc::c_int) -> io::Result<()> {
        // SAFETY: fcntl on a descriptor we own with an integer argument.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub(super) fn sealed_against_shrinking(file: &File) -> io::Result<bool> {
        // SAFETY: fcntl on a descriptor we own, no pointer argument.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(seals & libc::F_SEAL_SHRINK != 0)
    }

    /// No new writable mapping and no `write` from now on, by anyone (mappings made before
    /// keep writing: the owner's).
    pub(super) fn seal_future_writes(file: &File) -> io::Result<()> {
        add_seals(file, SEALS | libc::F_SEAL_FUTURE_WRITE)
    }

    pub(super) fn sealed_for_readers(file: &File) -> io::Result<bool> {
        // SAFETY: fcntl on a descriptor we own, no pointer argument.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(seals & libc::F_SEAL_SHRINK != 0 && seals & libc::F_SEAL_FUTURE_WRITE != 0)
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    use std::fs::File;
    use std::io;

    pub(super) fn sealed_memfd(_len: usize) -> io::Result<File> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub(super) fn sealed_against_shrinking(_file: &File) -> io::Result<bool> {
        Ok(false)
    }

    pub(super) fn memfd(_len: usize) -> io::Result<File> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub(super) fn seal_future_writes(_file: &File) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub(super) fn sealed_for_readers(_file: &File) -> io::Result<bool> {
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_copy_in_and_out_and_refuse_out_of_bounds() {
        let (file, owner) = SharedSlots::create(3, 4096).expect("memfd");
        let peer = SharedSlots::open(&file, 3, 4096).expect("maps");
        owner.copy_in(2, &[7; 100]).expect("in");
        let mut out = [0u8; 100];
        peer.copy_out(2, &mut out).expect("out");
        assert_eq!(out, [7; 100], "the same memory in both mappings");
        assert!(peer.copy_out(3, &mut out).is_err(), "past the last slot");
        assert!(owner.copy_in(0, &[0; 4097]).is_err(), "over a slot");
        assert!(peer.copy_in(0, &[1; 10]).is_err(), "a client's mapping is read-only");
        assert!(SharedSlots::open(&file, 4, 4096).is_err(), "a size it is not");
        let plain = tempfile_like();
        assert!(SharedSlots::open(&plain, 1, 4096).is_err(), "an unsealed file");
    }

    /// Once the owner has mapped it, nobody can write the memory another way: not a writable
    /// mapping of the descriptor a client got, not `write` through a fresh open of it.
    #[test]
    fn only_the_owners_mapping_writes_a_pools_memory() {
        use std::os::unix::fs::FileExt;
        let (file, owner) = SharedSlots::create(1, 4096).expect("memfd");
        let writable = memmap2::MmapOptions::new().len(4096).map_raw(&file);
        assert!(writable.is_err(), "a writable mapping is refused");
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
        let reopened = std::fs::OpenOptions::new().write(true).open(&path);
        assert!(reopened.and_then(|f| f.write_all_at(&[9; 8], 0)).is_err(), "a write is refused");
        owner.copy_in(0, &[5; 8]).expect("the owner's mapping writes");
        let mut out = [0u8; 8];
        SharedSlots::open(&file, 1, 4096).expect("read-only map").copy_out(0, &mut out).expect("out");
        assert_eq!(out, [5; 8]);
    }

    fn tempfile_like() -> File {
        let p = std::env::temp_dir().join(format!("tokenpath-shm-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&p);
        let f = f.expect("file");
        f.set_len(4096).expect("len");
        let _ = std::fs::remove_file(&p);
        f
    }
}
