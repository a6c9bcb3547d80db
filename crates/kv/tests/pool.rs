//! The KV pool through its real socket and shared memory: clients in this process and in a
//! child process (killed mid-lease), the host going away and the next client hosting it again
//! from the SSD tier, a client that tries to write a slot, and hellos that do not match.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokenpath_kv::pool::{Fill, FillItem, PoolClient, PoolConfig, PoolWriter};
use tokenpath_kv::{chain_hash, BlockHash};

const BLOCK: usize = 5000;

fn ns() -> BlockHash {
    BlockHash::namespace(&[b"kv pool integration"])
}

fn key(i: u32) -> BlockHash {
    chain_hash(ns(), &[i])
}

fn keys(ids: std::ops::Range<u32>) -> Vec<BlockHash> {
    ids.map(key).collect()
}

fn block(i: usize) -> Vec<u8> {
    (0..BLOCK).map(|j| (i * 7 + j * 13) as u8).collect()
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tokenpath-pool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(d: &std::path::Path) -> PoolConfig {
    PoolConfig { ram_bytes: 8 * 8192, ssd_bytes: 1 << 20, ..PoolConfig::new(d) }
}

/// Loads every block of a run and checks each is the one stored; returns how many.
fn load_all(c: &mut PoolClient, ids: std::ops::Range<u32>) -> usize {
    let lease = c.lookup(&keys(ids.clone()));
    let n = lease.blocks.len();
    for (b, i) in lease.blocks.iter().zip(ids) {
        let mut buf = vec![0; BLOCK];
        assert!(c.load(b, &mut buf), "block {i} loads and checks");
        assert_eq!(buf, block(i as usize));
    }
    c.release(lease, n);
    n
}

#[test]
fn a_block_stored_by_one_client_is_loaded_by_another_and_survives_its_host() {
    let d = dir("share");
    let mut host = PoolClient::new(config(&d), ns(), BLOCK);
    assert!(host.hosts() && host.connected());
    let mut other = PoolClient::new(config(&d), ns(), BLOCK);
    assert!(!other.hosts() && other.connected(), "the second process connects to the first's pool");
    assert_eq!(host.store(&keys(0..4), block), 4);
    assert_eq!(host.store(&keys(0..4), |_| unreachable!("held already: nothing to write")), 0);
    assert_eq!(load_all(&mut other, 0..6), 4);
    let s = other.stats().expect("stats");
    assert_eq!((s.ram_blocks, s.hits_ram, s.leases, s.pinned), (4, 4, 0, 0));

    // No client can write a slot (the RAM tier is mapped read-only by clients and sealed against
    // any other write), and a copy that does not match the owner's check is never used.
    let lease = other.lookup(&keys(0..1));
    let mut buf = vec![0; BLOCK];
    assert!(!scribble(&d, lease.blocks[0].slot), "a client's write is refused");
    assert!(other.load(&lease.blocks[0], &mut buf), "the block is intact");
    let mut wrong = lease.blocks[0].clone();
    wrong.check ^= 1;
    assert!(!other.load(&wrong, &mut buf), "a copy that fails its check is a failed load");
    other.release(lease, 0);
    assert_eq!(other.stats().expect("stats").hits_ram, 4, "and never a hit");
    // A block of the wrong size is refused before anything is sent.
    let r = other.reserve(&keys(40..41)).expect("a slot");
    assert!(!other.write(r.lease, &[&[1u8; 7][..]]), "refused before it is sent");
    other.abandon(r.lease);

    // The host goes away (its blocks written down to SSD as it stops); the other client loses
    // the connection, and a second later hosts the pool itself, from the SSD tier.
    drop(host);
    assert!(other.lookup(&keys(1..2)).blocks.is_empty(), "the host is gone: a miss");
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(load_all(&mut other, 1..4), 3, "blocks 1..4 come back from SSD");
    assert!(other.hosts());
    let s = other.stats().expect("stats");
    assert_eq!(s.hits_ssd, 3);
    drop(other);
    let _ = std::fs::remove_dir_all(&d);
}

/// Tries to write garbage into a RAM slot the way a misbehaving client would; whether it could.
fn scribble(d: &std::path::Path, slot: u32) -> bool {
    let rogue = PoolClient::new(config(d), ns(), BLOCK);
    rogue.slots().expect("mapped").copy_in(slot, &[0xA5; 64]).is_ok()
}

#[test]
fn a_client_killed_while_it_holds_a_lease_pins_nothing_afterwards() {
    if let Ok(d) = std::env::var("TOKENPATH_POOL_CHILD") {
        // The child: lease the blocks, say so, and wait to be killed.
        let mut c = PoolClient::new(config(std::path::Path::new(&d)), ns(), BLOCK);
        let lease = c.lookup(&keys(0..3));
        println!("leased {}", lease.blocks.len());
        std::thread::sleep(Duration::from_secs(60));
        return;
    }
    let d = dir("kill");
    let mut host = PoolClient::new(config(&d), ns(), BLOCK);
    assert_eq!(host.store(&keys(0..3), block), 3);
    let me = std::env::current_exe().expect("test binary");
    let mut child = Command::new(me)
        .args(["--exact", "a_client_killed_while_it_holds_a_lease_pins_nothing_afterwards", "--nocapture"])
        .env("TOKENPATH_POOL_CHILD", &d)
        .stdout(Stdio::piped())
        .spawn()
        .expect("child");
    let mut out = child.stdout.take().expect("stdout");
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !seen.contains("leased 3") && Instant::now() < deadline {
        let mut b = [0u8; 256];
        let n = std::io::Read::read(&mut out, &mut b).expect("read");
        if n == 0 {
            break;
        }
        seen.push_str(&String::from_utf8_lossy(&b[..n]));
    }
    assert!(seen.contains("leased 3"), "child said {seen:?}");
    let s = host.stats().expect("stats");
    assert_eq!((s.leases, s.pinned), (1, 3), "the child's lease pins its three blocks");
    child.kill().expect("kill");
    child.wait().expect("wait");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = host.stats().expect("stats");
    while s.pinned != 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        s = host.stats().expect("stats");
    }
    assert_eq!((s.leases, s.pinned, s.leases_expired), (0, 0, 1), "its lease ended with its connection");
    drop(host);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_client_of_another_block_size_is_refused_and_serves_without_the_pool() {
    let d = dir("hello");
    let mut host = PoolClient::new(config(&d), ns(), BLOCK);
    assert_eq!(host.store(&keys(0..1), block), 1);
    let mut other = PoolClient::new(config(&d), ns(), BLOCK + 1);
    assert!(!other.connected() && !other.hosts(), "refused, and the pool is hosted already");
    assert!(other.lookup(&keys(0..1)).blocks.is_empty());
    // Another namespace in the same directory is another pool.
    let other_ns = BlockHash::namespace(&[b"other weights"]);
    let mut third = PoolClient::new(config(&d), other_ns, BLOCK);
    assert!(third.hosts(), "its own pool");
    assert!(third.lookup(&keys(0..1)).blocks.is_empty(), "never another namespace's blocks");
    drop((host, other, third));
    let _ = std::fs::remove_dir_all(&d);
}

/// Polls `writer` for fills until it is idle (at most 10 s), answering each with `answer`.
fn drain(writer: &PoolWriter, mut answer: impl FnMut(&mut Fill)) {
    let until = Instant::now() + Duration::from_secs(10);
    while writer.busy() {
        assert!(Instant::now() < until, "the writer never finished");
        if let Some(mut f) = writer.next_fill() {
            answer(&mut f);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn items(ids: std::ops::Range<u32>) -> Vec<FillItem> {
    ids.map(|i| FillItem { key: key(i), tag: u64::from(i) }).collect()
}

/// The writer behind a worker: it hosts the pool, asks only for the blocks the pool lacks, and
/// stores what the worker copies; a fill the worker cannot answer in full stores nothing and
/// ends its lease.
#[test]
fn the_writer_stores_only_what_the_pool_lacks_and_every_lease_ends() {
    let d = dir("writer");
    let writer = PoolWriter::start(config(&d), ns(), BLOCK).expect("writer");
    let mut reader = PoolClient::connect_only(config(&d), ns(), BLOCK);
    assert!(reader.connected() && !reader.hosts(), "the writer hosts the pool; this client only connects");

    let mut asked = Vec::new();
    assert!(writer.store(items(0..3)));
    drain(&writer, |f| {
        for i in 0..f.items().len() {
            let tag = f.items()[i].tag;
            asked.push(tag);
            f.buffer(i).expect("buffer").copy_from_slice(&block(tag as usize));
            f.written(i);
        }
    });
    assert_eq!(asked, [0, 1, 2]);
    assert_eq!(load_all(&mut reader, 0..3), 3, "stored and checked");
    assert_eq!(writer.counters().stored.load(std::sync::atomic::Ordering::Relaxed), 3);

    // Blocks 1 and 2 are held: only 3 and 4 are asked for. Block 4 cannot be given (gone from
    // the worker's cache): the fill stores nothing.
    asked.clear();
    assert!(writer.store(items(1..5)));
    drain(&writer, |f| {
        for i in 0..f.items().len() {
            let tag = f.items()[i].tag;
            asked.push(tag);
            if tag == 3 {
                f.buffer(i).expect("buffer").copy_from_slice(&block(3));
                f.written(i);
            }
        }
    });
    assert_eq!(asked, [3, 4], "held blocks are never asked for");
    assert_eq!(load_all(&mut reader, 0..5), 3, "nothing of the partial fill is stored");
    assert_eq!(writer.counters().abandoned.load(std::sync::atomic::Ordering::Relaxed), 1);
    let stats = reader.stats().expect("stats");
    assert_eq!((stats.leases, stats.pinned), (0, 0), "every lease ended");

    // A fill dropped unanswered (a worker stopping) ends its lease too.
    assert!(writer.store(items(5..7)));
    drain(&writer, |_| {});
    assert_eq!(reader.stats().expect("stats").leases, 0);
    drop(writer);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_connect_only_client_never_hosts() {
    let d = dir("connect-only");
    let c = PoolClient::connect_only(config(&d), ns(), BLOCK);
    assert!(!c.connected() && !c.hosts(), "nobody hosts the pool, and this client does not");
    let _ = std::fs::remove_dir_all(&d);
}
