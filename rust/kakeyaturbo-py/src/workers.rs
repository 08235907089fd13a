//! Where the bindings run the codec's parallel work.
//!
//! **On torch's OpenMP team** when torch runs more than one intra-op thread
//! (`torch.set_num_threads`; `openmp.rs`): the codec's loops become regions of that team, so
//! the codec uses the threads torch uses, and no second set of threads competes with torch's
//! spinning ones for the cores. [`share_torch_threads`] turns this off, and so does
//! `OMP_WAIT_POLICY=PASSIVE` ([`follow_wait_policy`]).
//!
//! **On a rayon pool the calling thread belongs to** otherwise (torch on one thread leaves the
//! other cores idle; a numpy caller has no team to lend). A decode step calls the attention
//! kernels once per layer with a few milliseconds of the model's own work between calls, long
//! enough for rayon's workers to fall asleep. On rayon's global pool the calling thread only
//! waits: every call wakes the workers, and every fork inside it waits for a woken one.
//! That made the calls measurably slower than back to back (`docs/performance.md`). Here the caller
//! is worker 0 of its own pool: it starts on the work at once, and the other workers join as
//! they wake. Each thread that calls gets its own pool, of rayon's default size
//! (`RAYON_NUM_THREADS`, or one thread per core), built on its first call and dropped when the
//! thread ends. A caller that is already a rayon worker (of its own pool, or inside another)
//! runs where it is.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicBool, Ordering};

use kakeyaturbo::parallel::{self, Team};
use pyo3::marker::Ungil;
use pyo3::prelude::*;
use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::openmp;

static SHARE_TORCH_THREADS: AtomicBool = AtomicBool::new(true);

/// Whether the codec runs on torch's OpenMP team when torch has more than one thread (on by
/// default, off where `OMP_WAIT_POLICY=PASSIVE`); sets it to `enabled` and returns what it
/// was. Off, the codec keeps to its own rayon pool whatever torch does.
#[pyfunction]
pub fn share_torch_threads(enabled: bool) -> bool {
    SHARE_TORCH_THREADS.swap(enabled, Ordering::Relaxed)
}

/// The default of [`share_torch_threads`] from the environment, read once at import: off where
/// `OMP_WAIT_POLICY=PASSIVE`. Torch's OpenMP threads then sleep between its ops instead of
/// spinning, so the codec's own pool no longer fights them for the cores, and its idle worker
/// makes the next layers' keys beside the model (which it cannot do on torch's team): under
/// that policy the codec's pool is the faster of the two, under the default policy torch's
/// team is (`docs/performance.md`).
pub fn follow_wait_policy() {
    let passive =
        std::env::var("OMP_WAIT_POLICY").is_ok_and(|v| v.trim().eq_ignore_ascii_case("passive"));
    if passive {
        SHARE_TORCH_THREADS.store(false, Ordering::Relaxed);
    }
}

/// Where the codec's parallel loops run on this thread now: `("team", n)` on torch's OpenMP
/// team of `n` threads, `("rayon", n)` on a rayon pool of `n`.
#[pyfunction]
pub fn _workers(py: Python<'_>) -> (&'static str, usize) {
    detach(py, parallel::describe)
}

thread_local! {
    static POOL: OnceCell<Option<ThreadPool>> = const { OnceCell::new() };
}

/// Runs `f` with the GIL released on the calling thread's pool (see the module docs): its
/// parallel iterators split across that pool.
pub fn detach<R: Ungil + Send>(py: Python<'_>, f: impl FnOnce() -> R + Ungil + Send) -> R {
    py.detach(|| run(f))
}

fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if SHARE_TORCH_THREADS.load(Ordering::Relaxed) {
        if let Some(team) = openmp::runtime().filter(|t| t.threads() > 1) {
            return parallel::with_team(team, f);
        }
    }
    // (A thread stays worker 0 of its pool once built, so this is also every later call.)
    if rayon::current_thread_index().is_some() {
        return f();
    }
    POOL.with(|cell| match pool_of(cell) {
        Some(pool) => pool.install(f),
        None => f(),
    })
}

/// The calling thread's pool, built on first use (None if it cannot be).
fn pool_of(cell: &OnceCell<Option<ThreadPool>>) -> Option<&ThreadPool> {
    cell.get_or_init(|| {
        ThreadPoolBuilder::new()
            .use_current_thread()
            .thread_name(|i| format!("kakeyaturbo-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Runs `f` on another worker of the calling thread's pool while the caller goes on (its
/// loops in order on that worker: it runs beside the caller's parallel work, not in it).
/// False, with `f` dropped unrun, where no worker would be idle for it: when the codec runs on
/// torch's team (torch has more than one thread), or the pool has the caller alone.
pub fn spawn(f: impl FnOnce() + Send + 'static) -> bool {
    if SHARE_TORCH_THREADS.load(Ordering::Relaxed)
        && openmp::runtime().is_some_and(|t| t.threads() > 1)
    {
        return false;
    }
    POOL.with(|cell| {
        if rayon::current_thread_index().is_some() && cell.get().is_none() {
            return false; // a worker of some other pool: no pool of its own
        }
        match pool_of(cell) {
            Some(pool) if pool.current_num_threads() > 1 => {
                pool.spawn(move || parallel::sequential(f));
                true
            }
            _ => false,
        }
    })
}
