//! Storing a worker's fresh blocks in the pool off the thread that computes them.
//!
//! Why this shape: storing a 512-token prompt is 32 blocks of the default model — 12 MB to copy
//! into the RAM tier, 12 MB to hash, two round trips to the owner. Done on the batcher's thread
//! it sat between a prefill step and the KV transfer that step hands off (the `kv_transfer`
//! stage grew by 6–10 ms with the pool on), and between a decode step and the next. Here a
//! thread of its own, with its own connection, asks the owner for slots first (so blocks the
//! pool holds already — every block a PD decode worker receives from a prefill worker on the
//! same host — cost the batcher nothing), then hands the batcher a [`Fill`]: the blocks to copy
//! into private buffers, one memcpy each, between its steps. The writer sends those buffers to
//! the owner (only the owner writes the RAM tier), hashes them and commits.
//!
//! Every write lease ends: committed, abandoned when a block is gone from the worker's cache
//! by the time it is asked for (the [`Fill`]'s drop answers for every block it was not given),
//! abandoned when no answer comes within the lease's life, or with the connection.
//!
//! The writer's client is also the one that hosts the pool when nobody does: its thread, not
//! the batcher's, scans the SSD slab when a host died (see [`PoolClient::connect_only`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{PoolClient, PoolConfig};
use crate::BlockHash;

/// Store jobs at most in flight: past it, new blocks are not stored (a cache may drop a write;
/// the batcher must never wait on one).
const MAX_JOBS: usize = 16;
/// How often the writer checks its connection and its unanswered fills when nothing arrives.
const TICK: Duration = Duration::from_millis(500);
/// Block-sized buffers kept for reuse (a fresh one costs a page fault per 4 KiB).
const SPARE_BUFFERS: usize = 64;

/// One block a [`Fill`] asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FillItem {
    /// The block's key.
    pub key: BlockHash,
    /// What the caller gave with the key in [`PoolWriter::store`] (its block id).
    pub tag: u64,
}

/// The blocks the pool gave slots for, to be copied by the worker into [`Fill::buffer`]s. Dropping
/// it answers the writer: the blocks [`Fill::written`] are stored, and when any is missing none is.
pub struct Fill {
    items: Vec<FillItem>,
    buffers: Vec<Vec<u8>>,
    written: Vec<bool>,
    lease: u64,
    back: mpsc::Sender<Msg>,
}

impl std::fmt::Debug for Fill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fill").field("lease", &self.lease).field("items", &self.items.len()).finish()
    }
}

impl Fill {
    /// The blocks asked for, in key order.
    pub fn items(&self) -> &[FillItem] {
        &self.items
    }

    /// Where block `i`'s bytes go (one block's length).
    pub fn buffer(&mut self, i: usize) -> Option<&mut [u8]> {
        self.buffers.get_mut(i).map(Vec::as_mut_slice)
    }

    /// Block `i`'s buffer holds its bytes now.
    pub fn written(&mut self, i: usize) {
        if let Some(w) = self.written.get_mut(i) {
            *w = true;
        }
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        let buffers = std::mem::take(&mut self.buffers);
        let written = std::mem::take(&mut self.written);
        // The writer gone: its connection, and so the lease, ended with it.
        let _ = self.back.send(Msg::Filled { lease: self.lease, buffers, written });
    }
}

enum Msg {
    /// Keys of fresh blocks, each with the caller's tag.
    Store(Vec<FillItem>),
    /// A fill's answer.
    Filled { lease: u64, buffers: Vec<Vec<u8>>, written: Vec<bool> },
    /// The worker is stopping.
    Stop,
}

/// Counters of a writer (all since it started).
#[derive(Debug, Default)]
pub struct WriterCounters {
    /// Blocks indexed by the pool.
    pub stored: AtomicU64,
    /// Store jobs not taken because [`MAX_JOBS`] were in flight.
    pub dropped: AtomicU64,
    /// Write leases abandoned (a block gone from the worker's cache, or no answer in time).
    pub abandoned: AtomicU64,
}

/// The worker's side: hands keys to the writer thread and takes the [`Fill`]s it sends back.
pub struct PoolWriter {
    jobs: mpsc::Sender<Msg>,
    fills: mpsc::Receiver<Fill>,
    in_flight: Arc<AtomicUsize>,
    counters: Arc<WriterCounters>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PoolWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolWriter").field("in_flight", &self.in_flight.load(Ordering::Relaxed)).finish()
    }
}

impl PoolWriter {
    /// Connects to the pool of `namespace` (hosting it when nobody does, on the caller's thread
    /// so the first requests find it) and starts the writer thread.
    pub fn start(cfg: PoolConfig, namespace: BlockHash, block_bytes: usize) -> std::io::Result<Self> {
        let client = PoolClient::new(cfg, namespace, block_bytes);
        let (jobs, rx) = mpsc::channel();
        let (fill_tx, fills) = mpsc::channel();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let counters = Arc::new(WriterCounters::default());
        let mut thread = Thread {
            client,
            back: jobs.clone(),
            fills: fill_tx,
            in_flight: Arc::clone(&in_flight),
            counters: Arc::clone(&counters),
            block_bytes,
            pending: HashMap::new(),
            spare: Vec::new(),
        };
        let handle =
            std::thread::Builder::new().name("kv-pool-writer".into()).spawn(move || thread.run(rx))?;
        Ok(Self { jobs, fills, in_flight, counters, thread: Some(handle) })
    }

    /// Stores the blocks of `items` the pool lacks, later; `false` when not taken (too many
    /// jobs in flight).
    pub fn store(&self, items: Vec<FillItem>) -> bool {
        if items.is_empty() {
            return true;
        }
        if self.in_flight.load(Ordering::Acquire) >= MAX_JOBS {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        if self.jobs.send(Msg::Store(items)).is_err() {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// A fill the writer asks for, when one is waiting.
    pub fn next_fill(&self) -> Option<Fill> {
        self.fills.try_recv().ok()
    }

    /// Whether a job is in flight (a fill may still come: poll [`PoolWriter::next_fill`]).
    pub fn busy(&self) -> bool {
        self.in_flight() > 0
    }

    /// Jobs in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The writer's counters.
    pub fn counters(&self) -> &WriterCounters {
        &self.counters
    }
}

impl Drop for PoolWriter {
    fn drop(&mut self) {
        // Fills not taken are answered (dropped) first; then the thread stops, ending what it
        // still holds with its connection.
        while self.fills.try_recv().is_ok() {}
        let _ = self.jobs.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Pending {
    /// Blocks asked for.
    n: usize,
    asked: Instant,
}

struct Thread {
    client: PoolClient,
    back: mpsc::Sender<Msg>,
    fills: mpsc::Sender<Fill>,
    in_flight: Arc<AtomicUsize>,
    counters: Arc<WriterCounters>,
    block_bytes: usize,
    pending: HashMap<u64, Pending>,
    spare: Vec<Vec<u8>>,
}

impl Thread {
    fn run(&mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            match rx.recv_timeout(TICK) {
                Ok(Msg::Store(items)) => self.reserve(items),
                Ok(Msg::Filled { lease, buffers, written }) => self.filled(lease, buffers, written),
                Err(mpsc::RecvTimeoutError::Timeout) => self.tick(),
                Ok(Msg::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
    }

    fn done(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    fn reserve(&mut self, items: Vec<FillItem>) {
        let keys: Vec<BlockHash> = items.iter().map(|i| i.key).collect();
        let Some(r) = self.client.reserve(&keys) else { return self.done() };
        let asked: Vec<FillItem> =
            items.iter().zip(&r.slots).filter(|(_, s)| s.is_some()).map(|(item, _)| *item).collect();
        if asked.is_empty() {
            // The pool holds every block already.
            self.client.abandon(r.lease);
            return self.done();
        }
        let buffers = (0..asked.len()).map(|_| self.buffer()).collect();
        let fill = Fill {
            written: vec![false; asked.len()],
            items: asked,
            buffers,
            lease: r.lease,
            back: self.back.clone(),
        };
        self.pending.insert(r.lease, Pending { n: fill.items.len(), asked: Instant::now() });
        // A worker gone drops the fill, whose answer ends the lease.
        let _ = self.fills.send(fill);
    }

    fn buffer(&mut self) -> Vec<u8> {
        self.spare.pop().unwrap_or_else(|| vec![0; self.block_bytes])
    }

    fn filled(&mut self, lease: u64, buffers: Vec<Vec<u8>>, written: Vec<bool>) {
        let Some(p) = self.pending.remove(&lease) else {
            // Abandoned already (out of time): its buffers are still good.
            self.keep(buffers);
            return;
        };
        let whole = written.len() == p.n && buffers.len() == p.n && written.iter().all(|w| *w);
        let parts: Vec<&[u8]> = buffers.iter().map(Vec::as_slice).collect();
        let stored = if whole {
            self.client.put(lease, &parts)
        } else {
            self.client.abandon(lease);
            None
        };
        match stored {
            Some(n) => self.counters.stored.fetch_add(u64::from(n), Ordering::Relaxed),
            None => self.counters.abandoned.fetch_add(1, Ordering::Relaxed),
        };
        self.keep(buffers);
        self.done();
    }

    fn keep(&mut self, buffers: Vec<Vec<u8>>) {
        for b in buffers {
            if self.spare.len() < SPARE_BUFFERS && b.len() == self.block_bytes {
                self.spare.push(b);
            }
        }
    }

    /// Abandons fills unanswered for longer than a lease lives (the owner ended them anyway),
    /// and reconnects — hosting the pool when its host died.
    fn tick(&mut self) {
        let life = self.client.lease_life();
        let late: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.asked.elapsed() >= life).map(|(l, _)| *l).collect();
        for lease in late {
            self.pending.remove(&lease);
            self.client.abandon(lease);
            self.counters.abandoned.fetch_add(1, Ordering::Relaxed);
            self.done();
        }
        if !self.client.connected() {
            self.client.reconnect();
        } else if self.pending.is_empty() {
            // A host that died is seen by a call; the next tick then hosts it again.
            let _ = self.client.stats();
        }
    }
}
