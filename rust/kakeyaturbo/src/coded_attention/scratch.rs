//! Per-thread scratch buffers the kernels reuse across blocks and calls.

use std::cell::RefCell;

/// A thread's buffer for decoded blocks, lent to a call's tasks on that thread and kept by
/// the thread that drops it: a fresh one per call was a 196 KB allocation, zeroed, twice per
/// layer and step.
pub(super) struct Decoded(pub(super) Vec<f32>);

thread_local! {
    static DECODED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Decoded {
    pub(super) fn lend() -> Self {
        Decoded(DECODED.take())
    }
}

impl Drop for Decoded {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        // The larger buffer stays (none while the thread is exiting).
        let _ = DECODED.try_with(|c| {
            if c.borrow().capacity() < v.capacity() {
                c.replace(v);
            }
        });
    }
}

thread_local! {
    /// A block's keys, reused by every block this thread computes: a fresh buffer per block
    /// (192 KB for 256 tokens across three heads) was an allocation the size of an `mmap`,
    /// page faults and zeroing, about a tenth of a decode step's cycles.
    pub(super) static KEYS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A block's token scales and a tile's weights in [`block_sums`].
    pub(super) static SCALES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    pub(super) static WEIGHTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}
