//! torch's OpenMP team, lent to the codec's parallel loops (`workers.rs` says when).
//!
//! torch on Linux runs its intra-op work on an OpenMP team; after each parallel region the
//! team's threads spin for a while before they sleep, on the cores a pool of the codec's own
//! would need. Measured on SmolLM2 at 4k tokens, 2 cores, 2 torch threads: a decode step took
//! 2.3x DynamicCache's time with the codec on its own rayon pool, against 1.2x with 1 torch
//! thread. Running the codec's loops as OpenMP regions of that same team hands them to threads
//! that are awake already, and nothing else competes for the cores.
//!
//! The runtime is the one already loaded into the process with its symbols global (torch loads
//! its libgomp so), found by name: `GOMP_parallel` is the entry point that GCC compiles
//! `#pragma omp parallel` to, exported by libgomp and by LLVM's and Intel's runtimes alike.
//! Nothing is found where torch is not imported, or uses no OpenMP (then rayon runs the loops).

use std::any::Any;
use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use kakeyaturbo::parallel::Team;

type Body = unsafe extern "C" fn(*mut c_void);
type Parallel = unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint);
type Query = unsafe extern "C" fn() -> c_int;

/// The entry points of a loaded OpenMP runtime.
pub struct OpenMp {
    parallel: Parallel,
    max_threads: Query,
    thread_num: Query,
}

static FOUND: OnceLock<OpenMp> = OnceLock::new();

/// The OpenMP runtime loaded into the process, if one is (looked up again on every call until
/// one is: torch may be imported after the codec's first call).
pub fn runtime() -> Option<&'static OpenMp> {
    if let Some(r) = FOUND.get() {
        return Some(r);
    }
    let r = find()?;
    Some(FOUND.get_or_init(|| r))
}

#[cfg(unix)]
fn find() -> Option<OpenMp> {
    use std::ffi::CStr;
    // SAFETY: dlsym with RTLD_DEFAULT only reads the loader's tables; a null result is handled.
    let sym = |name: &CStr| unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    let (p, m, t) = (
        sym(c"GOMP_parallel"),
        sym(c"omp_get_max_threads"),
        sym(c"omp_get_thread_num"),
    );
    if p.is_null() || m.is_null() || t.is_null() {
        return None;
    }
    // SAFETY: the three symbols are the OpenMP runtime's own functions, with these C
    // signatures since GCC 4.9 (`GOMP_parallel`) and OpenMP 1.0 (the two queries).
    unsafe {
        Some(OpenMp {
            parallel: std::mem::transmute::<*mut c_void, Parallel>(p),
            max_threads: std::mem::transmute::<*mut c_void, Query>(m),
            thread_num: std::mem::transmute::<*mut c_void, Query>(t),
        })
    }
}

#[cfg(not(unix))]
fn find() -> Option<OpenMp> {
    None
}

/// One region's shared state: tasks are taken from a counter, so a thread that finishes early
/// takes more.
struct Region<'a> {
    next: AtomicUsize,
    tasks: usize,
    task: &'a (dyn Fn(usize, usize) + Sync),
    thread_num: Query,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// Every thread of the team runs this. A panic must not unwind into the C runtime: it is
/// caught, kept, and raised again on the calling thread once the region has ended.
unsafe extern "C" fn body(data: *mut c_void) {
    // SAFETY: `data` is the `Region` that `run` keeps alive until the region returns.
    let r = unsafe { &*(data as *const Region<'_>) };
    // SAFETY: an OpenMP query, called inside the region.
    let thread = unsafe { (r.thread_num)() }.max(0) as usize;
    loop {
        let i = r.next.fetch_add(1, Ordering::Relaxed);
        if i >= r.tasks {
            break;
        }
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| (r.task)(thread, i))) {
            let mut slot = r.panic.lock().unwrap_or_else(|e| e.into_inner());
            slot.get_or_insert(p);
        }
    }
}

impl Team for OpenMp {
    /// The team size a region started on this thread gets (torch's `set_num_threads`).
    fn threads(&self) -> usize {
        // SAFETY: an OpenMP query, callable from any thread.
        unsafe { (self.max_threads)() }.max(1) as usize
    }

    fn run(&self, tasks: usize, task: &(dyn Fn(usize, usize) + Sync)) {
        let threads = self.threads().min(tasks);
        if threads <= 1 {
            // Not worth waking the team; thread 0 is the caller, as in a region.
            (0..tasks).for_each(|i| task(0, i));
            return;
        }
        let region = Region {
            next: AtomicUsize::new(0),
            tasks,
            task,
            thread_num: self.thread_num,
            panic: Mutex::new(None),
        };
        // SAFETY: `GOMP_parallel` runs `body` on each thread of a team of at most `threads`
        // (the caller is thread 0) and returns when all have finished, so `region` outlives
        // every use; `body` never unwinds.
        unsafe {
            (self.parallel)(
                body,
                &region as *const Region<'_> as *mut c_void,
                threads as c_uint,
                0,
            )
        };
        if let Some(p) = region.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(p);
        }
    }
}
