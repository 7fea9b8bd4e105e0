//! The KV tiers below the pool: host memory and a file on disk, where a
//! preempted request's pages and the prefix cache's evicted pages go, and
//! come back from, instead of being recomputed.
//!
//! ```text
//!  tier 0, host:  blocks × page bytes in memory (--kv-offload-host-bytes)
//!  tier 1, disk:  blocks × page bytes in one file per node in --kv-offload-dir
//!                 (--kv-offload-disk-bytes), removed when the node stops
//!  block b of a tier: one pool page's bytes, as the pool lays a page out
//!
//!  step loop                          tier thread (one per node)
//!   page ──copy──▶ staging ──write──▶  block        (a store)
//!   page ◀──copy── staging ◀──read───  block        (a load)
//! ```
//!
//! The tier's I/O runs on its own thread and completes later: a store's
//! write into its block and a load's read out of it are jobs the step loop
//! queues and collects ([`Tiers::poll`]). The copies between a page and its
//! staging buffer are the step loop's, because the pool is its memory: a
//! store has read its source page when its staging copy is made (the hook
//! target is told then, with the digest of what it read), and a load
//! writes its page when its read has come back. Jobs run in the order
//! queued, so a read of a block sees every write queued before it; a write
//! that failed leaves its block unusable, and the node never serves it.
//!
//! The tiers copy and keep bytes; the node decides what goes out and back
//! and reports each store, load and release to the hook target, which
//! keeps each block's identity (`kvsan_sanitizer::tier`). Every copy is
//! digested (XXH3-64 of the page's bytes) where it was read and again
//! where it landed.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crossbeam_channel::{Receiver, Sender};
use half::f16;
use kvsan_sanitizer::TierBlockId;

use crate::error::PoolError;

/// The engine's number for its host-memory tier in the tier hooks.
pub const HOST_TIER: u32 = 0;
/// The engine's number for its disk tier in the tier hooks.
pub const DISK_TIER: u32 = 1;

/// The tiers, in number order, by name (the metrics' `tier` label).
pub const TIER_NAMES: [&str; 2] = ["host", "disk"];

/// Counters of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks the tier has.
    pub blocks: usize,
    /// Blocks holding a stored page now.
    pub used: usize,
    /// Pages stored since start.
    pub stores: u64,
    /// Pages loaded back since start.
    pub loads: u64,
    /// Preempted requests that came back from the tier, and prefix-cache
    /// pages served from it, since start.
    pub hits: u64,
    /// Writes or reads the tier's I/O failed since start (the blocks they
    /// concerned were not served).
    pub io_errors: u64,
}

/// Where a node's tiers are and how large: the engine configuration's part.
#[derive(Clone, Debug, Default)]
pub struct TierConfig {
    /// Bytes of host memory (0: no host tier).
    pub host_bytes: usize,
    /// The directory of the disk tier's file (`None`: no disk tier).
    pub disk_dir: Option<PathBuf>,
    /// Bytes of the disk tier's file.
    pub disk_bytes: usize,
}

impl TierConfig {
    /// Whether any tier is configured.
    #[must_use]
    pub fn any(&self) -> bool {
        self.host_bytes > 0 || self.disk_dir.is_some()
    }
}

/// Where a tier keeps its blocks.
enum Backing {
    Memory(Vec<f16>),
    File { file: File, path: PathBuf },
}

impl Backing {
    fn write(&mut self, b: u64, data: &[f16]) -> std::io::Result<()> {
        let n = data.len();
        match self {
            Backing::Memory(mem) => {
                mem[b as usize * n..(b as usize + 1) * n].copy_from_slice(data);
                Ok(())
            }
            Backing::File { file, .. } => {
                file.write_all_at(bytemuck::cast_slice(data), b * (n as u64) * 2)
            }
        }
    }

    fn read(&self, b: u64, out: &mut [f16]) -> std::io::Result<()> {
        let n = out.len();
        match self {
            Backing::Memory(mem) => {
                out.copy_from_slice(&mem[b as usize * n..(b as usize + 1) * n]);
                Ok(())
            }
            Backing::File { file, .. } => {
                file.read_exact_at(bytemuck::cast_slice_mut(out), b * (n as u64) * 2)
            }
        }
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if let Backing::File { path, .. } = self
            && let Err(e) = std::fs::remove_file(&*path)
        {
            tracing::warn!(path = %path.display(), "could not remove the disk KV tier's file: {e}");
        }
    }
}

/// A job for the tier thread.
enum Job {
    Write { id: TierBlockId, data: Vec<f16> },
    Read { id: TierBlockId, ticket: u64 },
}

/// A job the tier thread finished.
enum Done {
    Written {
        id: TierBlockId,
        result: Result<(), String>,
    },
    Read {
        id: TierBlockId,
        ticket: u64,
        result: Result<Vec<f16>, String>,
    },
}

/// What became of a block's read.
#[derive(Debug)]
pub(crate) enum ReadState {
    /// Not asked for, or still on the tier thread.
    Pending,
    /// The block's bytes, read.
    Ready(Vec<f16>),
    /// The read, or the write before it, failed (said why).
    Failed(String),
}

/// One tier's blocks, as the step loop sees them.
struct Blocks {
    free: Vec<u64>,
    live: Vec<bool>,
    stats: TierStats,
}

/// A node's tiers and the thread that does their I/O.
pub(crate) struct Tiers {
    page_elems: usize,
    tiers: [Option<Blocks>; 2],
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    worker: Option<std::thread::JoinHandle<()>>,
    /// Blocks whose write is queued and not yet done.
    writing: HashSet<TierBlockId>,
    /// Blocks whose last write failed (why).
    broken: HashMap<TierBlockId, String>,
    /// Reads asked for: their ticket, and what came back.
    reads: HashMap<TierBlockId, (u64, ReadState)>,
    ticket: u64,
}

impl std::fmt::Debug for Tiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tiers")
            .field("stats", &self.stats())
            .field("writing", &self.writing.len())
            .finish_non_exhaustive()
    }
}

impl Tiers {
    /// The tiers `cfg` asks for, for pages of `page_elems` f16 values, on
    /// the node named `node`; `None` when it asks for none.
    ///
    /// # Errors
    /// A tier that holds no whole page, a directory that is not one, a
    /// file that cannot be made that large, memory that cannot be
    /// allocated: each named, with the size asked for.
    pub fn new(
        page_elems: usize,
        cfg: &TierConfig,
        node: &str,
    ) -> Result<Option<Tiers>, crate::EngineError> {
        if !cfg.any() {
            return Ok(None);
        }
        let page_bytes = page_elems * 2;
        let config = |what: String| crate::EngineError::Config { what };
        let mut backings: [Option<(Backing, usize)>; 2] = [None, None];
        if cfg.host_bytes > 0 {
            let blocks = cfg.host_bytes / page_bytes;
            if blocks == 0 {
                return Err(config(format!(
                    "a host KV tier of {} bytes holds no page: a page of this model is {page_bytes} bytes",
                    cfg.host_bytes
                )));
            }
            let mut mem = Vec::new();
            mem.try_reserve_exact(blocks * page_elems)
                .map_err(|_| PoolError::TooLarge {
                    pages: blocks,
                    page_bytes,
                })?;
            mem.resize(blocks * page_elems, f16::ZERO);
            backings[HOST_TIER as usize] = Some((Backing::Memory(mem), blocks));
        }
        if let Some(dir) = &cfg.disk_dir {
            let blocks = cfg.disk_bytes / page_bytes;
            if blocks == 0 {
                return Err(config(format!(
                    "a disk KV tier of {} bytes (--kv-offload-disk-bytes) holds no page: a page of this model is {page_bytes} bytes",
                    cfg.disk_bytes
                )));
            }
            let (file, path) = tier_file(dir, node, (blocks * page_bytes) as u64)?;
            backings[DISK_TIER as usize] = Some((Backing::File { file, path }, blocks));
        }
        let tiers = backings.each_ref().map(|b| {
            b.as_ref().map(|(_, blocks)| Blocks {
                free: (0..*blocks as u64).rev().collect(),
                live: vec![false; *blocks],
                stats: TierStats {
                    blocks: *blocks,
                    ..TierStats::default()
                },
            })
        });
        let backings = backings.map(|b| b.map(|(backing, _)| backing));
        let (jobs, job_rx) = crossbeam_channel::unbounded();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let worker = std::thread::Builder::new()
            .name(format!("kvsan-tier-{node}"))
            .spawn(move || tier_thread(backings, page_elems, &job_rx, &done_tx))
            .map_err(|e| config(format!("cannot start the KV tier thread: {e}")))?;
        Ok(Some(Tiers {
            page_elems,
            tiers,
            jobs: Some(jobs),
            done,
            worker: Some(worker),
            writing: HashSet::new(),
            broken: HashMap::new(),
            reads: HashMap::new(),
            ticket: 0,
        }))
    }

    /// Whether tier `tier` exists.
    pub fn has(&self, tier: u32) -> bool {
        self.blocks(tier).is_some()
    }

    fn blocks(&self, tier: u32) -> Option<&Blocks> {
        self.tiers.get(tier as usize)?.as_ref()
    }

    fn blocks_mut(&mut self, tier: u32) -> Option<&mut Blocks> {
        self.tiers.get_mut(tier as usize)?.as_mut()
    }

    /// Blocks of `tier` no stored page holds.
    pub fn free_blocks(&self, tier: u32) -> usize {
        self.blocks(tier).map_or(0, |t| t.free.len())
    }

    /// A free block of `tier`, now held.
    pub fn take(&mut self, tier: u32) -> Option<TierBlockId> {
        let t = self.blocks_mut(tier)?;
        let b = t.free.pop()?;
        t.live[b as usize] = true;
        t.stats.used += 1;
        Some(TierBlockId::new(tier, b))
    }

    /// Block `id` is free again; what was read of it is forgotten. A block
    /// already free is left as it is (and logged).
    pub fn put_back(&mut self, id: TierBlockId) {
        self.reads.remove(&id);
        self.broken.remove(&id);
        let Some(t) = self.blocks_mut(id.tier) else {
            return;
        };
        match t.live.get_mut(id.block as usize) {
            Some(live) if *live => {
                *live = false;
                t.free.push(id.block);
                t.stats.used -= 1;
            }
            _ => tracing::error!(block = %id, "a tier block let go of twice"),
        }
    }

    /// Queues the write of `data` (a page's bytes, read by the caller)
    /// into block `id`.
    pub fn write(&mut self, id: TierBlockId, data: Vec<f16>) {
        debug_assert_eq!(data.len(), self.page_elems);
        self.reads.remove(&id);
        self.broken.remove(&id);
        self.writing.insert(id);
        if let Some(t) = self.blocks_mut(id.tier) {
            t.stats.stores += 1;
        }
        self.send(Job::Write { id, data });
    }

    /// Asks for block `id`'s bytes (once; again after a failed read).
    pub fn request_read(&mut self, id: TierBlockId) {
        if matches!(
            self.reads.get(&id),
            Some((_, ReadState::Pending | ReadState::Ready(_)))
        ) {
            return;
        }
        self.ticket += 1;
        let ticket = self.ticket;
        self.reads.insert(id, (ticket, ReadState::Pending));
        self.send(Job::Read { id, ticket });
    }

    /// Where block `id`'s read stands; a ready read is handed over (asked
    /// for again, it is read again).
    pub fn take_read(&mut self, id: TierBlockId) -> ReadState {
        match self.reads.remove(&id) {
            None => ReadState::Pending,
            Some((t, ReadState::Pending)) => {
                self.reads.insert(id, (t, ReadState::Pending));
                ReadState::Pending
            }
            Some((_, done)) => done,
        }
    }

    /// Whether `id`'s read has come back (ready or failed).
    pub fn read_done(&self, id: TierBlockId) -> bool {
        matches!(
            self.reads.get(&id),
            Some((_, ReadState::Ready(_) | ReadState::Failed(_)))
        )
    }

    /// A page `id`'s tier loaded back (the counters).
    pub fn count_load(&mut self, id: TierBlockId, hit: bool) {
        if let Some(t) = self.blocks_mut(id.tier) {
            t.stats.loads += 1;
            t.stats.hits += u64::from(hit);
        }
    }

    /// Collects what the tier thread finished.
    pub fn poll(&mut self) {
        while let Ok(done) = self.done.try_recv() {
            self.finish(done);
        }
    }

    /// Waits for the tier thread to finish everything queued so far.
    #[cfg(test)]
    pub fn drain(&mut self) {
        while !self.writing.is_empty()
            || self
                .reads
                .values()
                .any(|(_, s)| matches!(s, ReadState::Pending))
        {
            match self.done.recv() {
                Ok(done) => self.finish(done),
                Err(_) => return,
            }
        }
    }

    /// Waits up to `timeout` for the tier thread to finish something, when
    /// something is queued.
    pub fn wait(&mut self, timeout: std::time::Duration) {
        let busy = !self.writing.is_empty()
            || self
                .reads
                .values()
                .any(|(_, s)| matches!(s, ReadState::Pending));
        if busy && let Ok(done) = self.done.recv_timeout(timeout) {
            self.finish(done);
            self.poll();
        }
    }

    fn finish(&mut self, done: Done) {
        match done {
            Done::Written { id, result } => {
                self.writing.remove(&id);
                if let Err(e) = result {
                    tracing::error!(block = %id, "a KV tier write failed: {e}");
                    self.count_io_error(id);
                    self.broken.insert(id, e);
                }
            }
            Done::Read { id, ticket, result } => {
                let Some((t, state)) = self.reads.get_mut(&id) else {
                    return;
                };
                if *t != ticket {
                    return;
                }
                *state = match (self.broken.get(&id), result) {
                    (Some(why), _) => ReadState::Failed(format!("its write failed: {why}")),
                    (None, Ok(data)) => ReadState::Ready(data),
                    (None, Err(e)) => {
                        tracing::error!(block = %id, "a KV tier read failed: {e}");
                        ReadState::Failed(e)
                    }
                };
                if matches!(state, ReadState::Failed(_)) {
                    self.count_io_error(id);
                }
            }
        }
    }

    fn count_io_error(&mut self, id: TierBlockId) {
        if let Some(t) = self.blocks_mut(id.tier) {
            t.stats.io_errors += 1;
        }
    }

    fn send(&mut self, job: Job) {
        let sent = self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        if !sent {
            // The thread is gone (it panicked): nothing queued will come
            // back; every block is unusable from now on.
            tracing::error!("the KV tier thread is gone");
        }
    }

    /// The counters of each tier, in number order (zero for a tier not
    /// configured).
    pub fn stats(&self) -> [TierStats; 2] {
        self.tiers
            .each_ref()
            .map(|t| t.as_ref().map(|t| t.stats).unwrap_or_default())
    }
}

impl Drop for Tiers {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The tier thread: runs jobs in order until the node lets go of it.
fn tier_thread(
    mut backings: [Option<Backing>; 2],
    page_elems: usize,
    jobs: &Receiver<Job>,
    done: &Sender<Done>,
) {
    for job in jobs {
        let out = match job {
            Job::Write { id, data } => Done::Written {
                id,
                result: match backings.get_mut(id.tier as usize).and_then(Option::as_mut) {
                    Some(b) => b.write(id.block, &data).map_err(|e| e.to_string()),
                    None => Err(format!("no tier {}", id.tier)),
                },
            },
            Job::Read { id, ticket } => {
                let mut data = vec![f16::ZERO; page_elems];
                let result = match backings.get(id.tier as usize).and_then(Option::as_ref) {
                    Some(b) => b.read(id.block, &mut data).map_err(|e| e.to_string()),
                    None => Err(format!("no tier {}", id.tier)),
                };
                Done::Read {
                    id,
                    ticket,
                    result: result.map(|()| data),
                }
            }
        };
        if done.send(out).is_err() {
            return;
        }
    }
}

/// The disk tier's file in `dir`, `bytes` long, named for this process,
/// engine and node.
fn tier_file(dir: &Path, node: &str, bytes: u64) -> Result<(File, PathBuf), crate::EngineError> {
    let config = |what: String| crate::EngineError::Config { what };
    if !dir.is_dir() {
        return Err(config(format!(
            "--kv-offload-dir {}: not a directory",
            dir.display()
        )));
    }
    // One file per node of each engine: the process, a count of the files
    // it made, the node.
    static FILES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("kvsan-kv-{}-{n}-{node}.tier", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| {
            config(format!(
                "--kv-offload-dir: cannot create {}: {e}",
                path.display()
            ))
        })?;
    if let Err(e) = file.set_len(bytes) {
        let _ = std::fs::remove_file(&path);
        return Err(config(format!(
            "--kv-offload-disk-bytes {bytes}: cannot size {} to it: {e}",
            path.display()
        )));
    }
    Ok((file, path))
}

/// The digest of one page's bytes (XXH3-64), the same for a block and for
/// a page that holds what the block holds. Never printed: it is derived
/// from KV.
pub(crate) fn digest(page: &[f16]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    crate::kv_pool::hash_f16(&mut hasher, page);
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: f32) -> Vec<f16> {
        (0..8).map(|i| f16::from_f32(seed + i as f32)).collect()
    }

    fn read_back(t: &mut Tiers, id: TierBlockId) -> ReadState {
        t.request_read(id);
        t.drain();
        t.take_read(id)
    }

    #[test]
    fn a_block_holds_what_was_written_in_either_tier() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TierConfig {
            host_bytes: 3 * 16 + 5,
            disk_dir: Some(dir.path().to_path_buf()),
            disk_bytes: 2 * 16,
        };
        let mut t = Tiers::new(8, &cfg, "test").unwrap().unwrap();
        let [host, disk] = t.stats();
        assert_eq!((host.blocks, disk.blocks), (3, 2), "whole pages only");
        for tier in [HOST_TIER, DISK_TIER] {
            let id = t.take(tier).unwrap();
            t.write(id, page(tier as f32));
            match read_back(&mut t, id) {
                ReadState::Ready(data) => {
                    assert_eq!(data, page(tier as f32));
                    assert_eq!(digest(&data), digest(&page(tier as f32)));
                }
                other => panic!("{other:?}"),
            }
            t.put_back(id);
            t.put_back(id);
            assert_eq!(
                t.stats()[tier as usize].used,
                0,
                "a second release changes nothing"
            );
        }
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(files, 1);
        drop(t);
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the file goes with the node"
        );
    }

    #[test]
    fn a_read_queued_after_a_write_sees_it() {
        let cfg = TierConfig {
            host_bytes: 16,
            ..TierConfig::default()
        };
        let mut t = Tiers::new(8, &cfg, "test").unwrap().unwrap();
        let id = t.take(HOST_TIER).unwrap();
        t.write(id, page(1.0));
        t.request_read(id);
        t.write(id, page(5.0));
        t.drain();
        assert!(
            matches!(t.take_read(id), ReadState::Pending),
            "a write after the read asked for it voids it"
        );
        match read_back(&mut t, id) {
            ReadState::Ready(data) => assert_eq!(data, page(5.0)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tier_too_small_for_a_page_or_a_missing_directory_is_refused() {
        let small = TierConfig {
            host_bytes: 15,
            ..TierConfig::default()
        };
        let e = Tiers::new(8, &small, "n").unwrap_err().to_string();
        assert!(e.contains("15 bytes") && e.contains("16 bytes"), "{e}");
        let missing = TierConfig {
            disk_dir: Some("/nonexistent/kvsan".into()),
            disk_bytes: 1 << 20,
            ..TierConfig::default()
        };
        let e = Tiers::new(8, &missing, "n").unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/kvsan") && e.contains("not a directory"),
            "{e}"
        );
        assert!(
            Tiers::new(8, &TierConfig::default(), "n")
                .unwrap()
                .is_none()
        );
    }
}
