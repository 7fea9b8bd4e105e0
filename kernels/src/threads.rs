//! The thread pool the kernels run on: persistent workers, one job at a time,
//! tasks handed out by an atomic counter, the calling thread working too.
//!
//! Decode calls ~200 small matrix-vector products per token, so dispatch must
//! cost microseconds: after a job a worker spins for a short, bounded time
//! (default 200 µs) watching for the next one, then parks on a condition
//! variable. When a core is shared with another process the spinning ends
//! quickly and the pool degrades to park/unpark instead of burning the core.
//!
//! ```text
//!  state: u64 = | epoch: 32 bits | open: 1 bit | active: 31 bits |
//!
//!  caller                                   worker
//!  ------                                   ------
//!  write job (fn, data, n_tasks), next = 0
//!  state = (epoch+1, open, 0)   ──────────▶ sees new epoch; CAS active+1 only while
//!  wake parked workers                      the same epoch is still open
//!  take tasks: next.fetch_add(1)            take tasks: next.fetch_add(1)
//!  clear open                               active-1 (wake the caller if it parked)
//!  wait until active == 0
//!  return (job borrowed from the stack is no longer referenced)
//! ```
//!
//! A worker that notices a job only after it closed does not join it, so a
//! descheduled worker never delays the caller unless it holds a task.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const OPEN: u64 = 1 << 31;
const ACTIVE_MASK: u64 = OPEN - 1;

#[inline]
fn epoch_of(s: u64) -> u32 {
    (s >> 32) as u32
}

thread_local! {
    /// Set while this thread runs pool tasks (or is a worker): nested jobs run inline.
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

/// Calls the closure behind `data` (an `F`) with task index `i`.
///
/// # Safety
/// `data` points to a live `F`.
unsafe fn trampoline<F: Fn(usize) + Sync>(data: *const (), i: usize) {
    // SAFETY: guaranteed by the caller (the job protocol keeps `F` alive).
    let f = unsafe { &*data.cast::<F>() };
    f(i);
}

struct Shared {
    state: AtomicU64,
    /// `*const F` of the current job.
    data: AtomicUsize,
    /// `unsafe fn(*const (), usize)` of the current job, as usize.
    call: AtomicUsize,
    n_tasks: AtomicUsize,
    next: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    spin: Duration,
    sleepers: AtomicUsize,
    work_lock: Mutex<()>,
    work_cv: Condvar,
    caller_parked: AtomicBool,
    done_lock: Mutex<()>,
    done_cv: Condvar,
}

impl Shared {
    /// Takes and runs tasks of the current job until none are left.
    ///
    /// # Safety
    /// The caller holds a share of the current job (it published it, or joined
    /// it by incrementing `active` while it was open), so `data` and `call`
    /// are those of a live job.
    unsafe fn run_tasks(&self) {
        let n = self.n_tasks.load(Ordering::Relaxed);
        let data = self.data.load(Ordering::Relaxed) as *const ();
        let call_bits = self.call.load(Ordering::Relaxed);
        // SAFETY: `call` holds a `trampoline::<F>` pointer stored by `run` for this job.
        let call: unsafe fn(*const (), usize) = unsafe { std::mem::transmute(call_bits) };
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            // SAFETY: `data` is the job's live closure (precondition) and `call` its trampoline.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { call(data, i) }));
            if r.is_err() {
                self.panicked.store(true, Ordering::Relaxed);
                self.next.store(n, Ordering::Relaxed);
            }
        }
    }

    /// Waits until the epoch differs from `seen`; `None` at shutdown.
    fn wait_new_epoch(&self, seen: u32) -> Option<u64> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = self.state.load(Ordering::Acquire);
            if epoch_of(s) != seen {
                return Some(s);
            }
            if self.shutdown.load(Ordering::Relaxed) {
                return None;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() >= self.spin {
                break;
            }
        }
        let mut guard = self.work_lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let result = loop {
            let s = self.state.load(Ordering::SeqCst);
            if epoch_of(s) != seen {
                break Some(s);
            }
            if self.shutdown.load(Ordering::SeqCst) {
                break None;
            }
            guard = self.work_cv.wait(guard).unwrap_or_else(|e| e.into_inner());
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        result
    }

    fn worker_loop(&self) {
        IN_POOL.with(|c| c.set(true));
        let mut seen = 0u32;
        while let Some(mut s) = self.wait_new_epoch(seen) {
            seen = epoch_of(s);
            let joined = loop {
                if epoch_of(s) != seen || s & OPEN == 0 {
                    break false;
                }
                match self.state.compare_exchange_weak(
                    s,
                    s + 1,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break true,
                    Err(now) => s = now,
                }
            };
            if !joined {
                continue;
            }
            // SAFETY: we joined the open job (active was incremented under the
            // same epoch), so the caller keeps the job alive until we leave it.
            unsafe { self.run_tasks() };
            let prev = self.state.fetch_sub(1, Ordering::SeqCst);
            if prev & ACTIVE_MASK == 1
                && prev & OPEN == 0
                && self.caller_parked.load(Ordering::SeqCst)
            {
                let _g = self.done_lock.lock().unwrap_or_else(|e| e.into_inner());
                self.done_cv.notify_one();
            }
        }
    }
}

/// A fixed set of worker threads that run data-parallel jobs.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Held while a job is in flight; the epoch counter lives inside.
    dispatch: Mutex<u32>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads())
            .finish()
    }
}

impl ThreadPool {
    /// A pool of `threads` threads in all: the calling thread plus
    /// `threads - 1` workers (`threads` 0 is taken as 1). Workers spin for up to
    /// 200 µs after a job before parking.
    #[must_use]
    pub fn new(threads: usize) -> ThreadPool {
        ThreadPool::with_spin(threads, Duration::from_micros(200))
    }

    /// As [`ThreadPool::new`], with the time a worker spins waiting for the
    /// next job before it parks.
    ///
    /// # Panics
    /// If the operating system refuses to start a thread.
    #[must_use]
    pub fn with_spin(threads: usize, spin: Duration) -> ThreadPool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            data: AtomicUsize::new(0),
            call: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            spin,
            sleepers: AtomicUsize::new(0),
            work_lock: Mutex::new(()),
            work_cv: Condvar::new(),
            caller_parked: AtomicBool::new(false),
            done_lock: Mutex::new(()),
            done_cv: Condvar::new(),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("kvsan-kernel-{i}"))
                    .spawn(move || shared.worker_loop())
                    .expect("starting a kernel worker thread")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            dispatch: Mutex::new(0),
        }
    }

    /// Threads that run a job: the workers plus the caller.
    #[must_use]
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0)`, …, `f(n_tasks - 1)`, each exactly once, spread over the
    /// pool; returns when all have finished. Runs inline (serially, on this
    /// thread) when called from inside a task, while another thread's job is
    /// in flight, or when there is a single task.
    ///
    /// # Panics
    /// If a task panics: the caller's own panic is resumed, a worker's is
    /// reported as a new panic, in both cases after every task has stopped.
    pub fn run<F: Fn(usize) + Sync>(&self, n_tasks: usize, f: F) {
        if n_tasks == 0 {
            return;
        }
        if n_tasks == 1 || self.workers.is_empty() || IN_POOL.with(Cell::get) {
            (0..n_tasks).for_each(&f);
            return;
        }
        let mut epoch = match self.dispatch.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..n_tasks).for_each(&f);
                return;
            }
        };
        let sh = &*self.shared;
        *epoch = epoch.wrapping_add(1);
        let trampoline_fn: unsafe fn(*const (), usize) = trampoline::<F>;
        sh.data
            .store(std::ptr::from_ref(&f) as usize, Ordering::Relaxed);
        sh.call.store(trampoline_fn as usize, Ordering::Relaxed);
        sh.n_tasks.store(n_tasks, Ordering::Relaxed);
        sh.next.store(0, Ordering::Relaxed);
        sh.panicked.store(false, Ordering::Relaxed);
        // Publish: the Release half orders the job fields before the new epoch.
        sh.state
            .store((u64::from(*epoch) << 32) | OPEN, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = sh.work_lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.work_cv.notify_all();
        }

        IN_POOL.with(|c| c.set(true));
        // SAFETY: we published this job and keep `f` alive until every worker
        // that joined has left (the wait below).
        let mine = catch_unwind(AssertUnwindSafe(|| unsafe { sh.run_tasks() }));
        IN_POOL.with(|c| c.set(false));

        sh.state.fetch_and(!OPEN, Ordering::SeqCst);
        self.wait_idle();
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if sh.panicked.load(Ordering::Relaxed) {
            panic!("a kernel task panicked on a pool thread");
        }
    }

    /// Waits until no worker is inside the (closed) current job.
    fn wait_idle(&self) {
        let sh = &*self.shared;
        let start = Instant::now();
        let mut spins = 0u32;
        while sh.state.load(Ordering::Acquire) & ACTIVE_MASK != 0 {
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() >= sh.spin {
                let mut guard = sh.done_lock.lock().unwrap_or_else(|e| e.into_inner());
                sh.caller_parked.store(true, Ordering::SeqCst);
                while sh.state.load(Ordering::SeqCst) & ACTIVE_MASK != 0 {
                    guard = sh.done_cv.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                sh.caller_parked.store(false, Ordering::SeqCst);
                break;
            }
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self
                .shared
                .work_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.work_cv.notify_all();
        }
        for w in self.workers.drain(..) {
            // A worker only ends by returning from its loop; a join error
            // would mean it panicked outside a task, which catch_unwind prevents.
            let _ = w.join();
        }
    }
}

/// The process-wide pool the kernels use: `KVSAN_THREADS` threads if that
/// environment variable holds a positive number at first use, else one per
/// available core.
pub fn global() -> &'static ThreadPool {
    static POOL: OnceLock<ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("KVSAN_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        ThreadPool::new(n)
    })
}

/// A raw pointer that tasks of one job may share, for writing disjoint
/// elements of one output slice.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(*mut T);

// SAFETY: the pointer is only dereferenced by tasks writing disjoint indices
// (each use site says why), and the slice outlives the job.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(s: &mut [T]) -> SharedMut<T> {
        SharedMut(s.as_mut_ptr())
    }

    /// The `len` elements starting at `start`.
    ///
    /// # Safety
    /// `start + len` is within the slice this was made from, which is still
    /// alive, and no other live reference covers those elements.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [0, 1, 2, 7, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn many_back_to_back_jobs_complete_after_workers_park() {
        let pool = ThreadPool::with_spin(2, Duration::from_micros(1));
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            pool.run(4, |i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
            if round % 500 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 10);
    }

    #[test]
    fn nested_and_concurrent_jobs_run_inline() {
        let pool = Arc::new(ThreadPool::new(2));
        let total = AtomicUsize::new(0);
        pool.run(4, |_| {
            pool.run(3, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..200 {
                        pool.run(5, |_| {
                            c.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    c.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 1000);
        }
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_stays_usable() {
        let pool = ThreadPool::new(2);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, |i| assert!(i != 9, "task nine fails"));
        }));
        assert!(r.is_err());
        let c = AtomicUsize::new(0);
        pool.run(16, |_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 16);
    }
}
