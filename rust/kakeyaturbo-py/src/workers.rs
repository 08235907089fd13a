//! Where the bindings run the codec's parallel work: on a rayon pool the calling thread
//! belongs to.
//!
//! A decode step calls the attention kernels once per layer with a few milliseconds of the
//! model's own work between calls, long enough for rayon's workers to fall asleep. On rayon's
//! global pool the calling thread only waits: every call wakes the workers, and every fork
//! inside it waits for a woken one. Measured on SmolLM2 at 4k tokens (2 cores, a loop over the
//! 30 layers with 2 ms of other work between calls), that made the calls 1.2-1.4x slower than
//! back to back. Here the caller is worker 0 of its own pool: it starts on the work at once,
//! and the other workers join as they wake.
//!
//! Each thread that calls gets its own pool, of rayon's default size (`RAYON_NUM_THREADS`, or
//! one thread per core), built on its first call and dropped when the thread ends. A caller
//! that is already a rayon worker (of its own pool, or inside another) runs where it is.

use std::cell::OnceCell;

use pyo3::marker::Ungil;
use pyo3::Python;
use rayon::{ThreadPool, ThreadPoolBuilder};

thread_local! {
    static POOL: OnceCell<Option<ThreadPool>> = const { OnceCell::new() };
}

/// Runs `f` with the GIL released on the calling thread's pool (see the module docs): its
/// parallel iterators split across that pool.
pub fn detach<R: Ungil + Send>(py: Python<'_>, f: impl FnOnce() -> R + Ungil + Send) -> R {
    py.detach(|| run(f))
}

fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    POOL.with(|cell| {
        let pool = cell.get_or_init(|| {
            ThreadPoolBuilder::new()
                .use_current_thread()
                .thread_name(|i| format!("kakeyaturbo-{i}"))
                .build()
                .ok()
        });
        match pool {
            Some(pool) => pool.install(f),
            None => f(),
        }
    })
}
