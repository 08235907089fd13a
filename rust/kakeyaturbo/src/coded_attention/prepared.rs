//! A layer's coded keys made ahead of its attention, on a thread that would otherwise wait.
//!
//! In a decode step the key kernel's query-independent part (decoding the codes, the frame
//! product, RoPE) is most of a layer's attention. With torch on one thread the codec's other
//! worker is idle while the model runs the layers' projections and MLPs, so the next layer's
//! keys can be made there ([`PreparedKeys::prepare`]) and its attention only dots them with
//! the queries ([`logits_with`](super::api::logits_with)).
//!
//! Each block has a state: to do, being prepared, prepared, or taken by attention. Preparing
//! walks the blocks from the last; attention walks from the first (rayon's first split) and
//! takes every block not yet being prepared, computing it itself as it would without
//! preparation, so the two meet with no block done twice and attention never waits for more
//! than the one block in progress. A prepared block's keys are the same bits attention would
//! make: the same kernels in the same order.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

use super::cpu::with_avx_fma;
use super::inputs::KeyInputs;
use super::kernels::{block_keys, dots_rows, length, Coords, KeyArgs, Rows};
use super::scratch::Decoded;
use super::streams::CodedStreams;
use crate::error::{Error, Result};

const TODO: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;
const TAKEN: u8 = 3;

/// One block's keys `[n, d]` as the key kernel dots them, and every token's `|y_t|` (at least
/// `MIN_NORM`) for a token-norm scale.
#[derive(Default)]
pub(crate) struct BlockKeys {
    pub keys: Vec<f32>,
    pub lengths: Vec<f32>,
}

impl BlockKeys {
    pub fn tokens(&self, d: usize) -> usize {
        self.keys.len() / d
    }
}

struct Slot {
    state: AtomicU8,
    keys: OnceLock<BlockKeys>,
}

/// The keys of a layer's coded blocks (stream-major, as [`CodedStreams`] lists them), made
/// ahead of its attention. Transient: made for one attention call and dropped after it.
pub struct PreparedKeys {
    slots: Vec<Slot>,
    cancelled: AtomicBool,
}

/// Sets a block being prepared back to "to do" unless it finished (an error or a panic while
/// preparing it): attention then computes it itself, and reports what went wrong.
struct Undo<'a> {
    state: &'a AtomicU8,
    done: bool,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.state.store(TODO, Ordering::Release);
        }
    }
}

impl PreparedKeys {
    /// Nothing prepared yet, for `blocks` coded blocks (all streams').
    pub fn new(blocks: usize) -> Self {
        Self {
            slots: (0..blocks)
                .map(|_| Slot {
                    state: AtomicU8::new(TODO),
                    keys: OnceLock::new(),
                })
                .collect(),
            cancelled: AtomicBool::new(false),
        }
    }

    /// Stops [`Self::prepare`] before its next block.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    /// Blocks prepared so far.
    pub fn prepared(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| s.state.load(Ordering::Acquire) == DONE)
            .count()
    }

    /// Makes the keys of `coded`'s blocks with `keys`, from the last block to the first,
    /// skipping those attention has taken, until every block is visited or [`Self::cancel`]
    /// is called. Runs on the calling thread alone. Returns the number of blocks it made.
    ///
    /// `token_norms`: whether the attention will scale the keys by token norms, which needs
    /// each token's `|y_t|`; without it int16 products may skip the decoded values
    /// ([`super::KeyInputs`]' levels), and an attention with norms makes such blocks again.
    pub fn prepare(
        &self,
        coded: &CodedStreams<'_>,
        keys: &KeyInputs<'_>,
        token_norms: bool,
    ) -> Result<usize> {
        self.check(coded)?;
        keys.check(coded)?;
        let (nb, d) = (coded.blocks(), coded.d);
        let products = keys.products(d);
        let levels = keys.levels(&products, !token_norms);
        let mut scratch = Decoded::lend();
        let mut made = 0;
        for (i, slot) in self.slots.iter().enumerate().rev() {
            if self.cancelled.load(Ordering::Relaxed) {
                break;
            }
            if slot
                .state
                .compare_exchange(TODO, BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            let mut undo = Undo {
                state: &slot.state,
                done: false,
            };
            let grid = coded.decode_keys(i, &mut scratch.0, levels)?;
            let (m, product, rot) = keys.block(coded, &products, i / nb, i % nb);
            let mut out = BlockKeys::default();
            let y = Coords::of(&scratch.0, grid.as_ref());
            run_prepare_block((y, d, m, product, rot), &mut out);
            // Only this thread moved the slot to BUSY, so it is empty.
            let _ = slot.keys.set(out);
            undo.done = true;
            slot.state.store(DONE, Ordering::Release);
            made += 1;
        }
        Ok(made)
    }

    /// Whether these were made for `coded`'s number of blocks.
    pub(super) fn check(&self, coded: &CodedStreams<'_>) -> Result<()> {
        if self.slots.len() != coded.encs.len() {
            return Err(Error::Shape(format!(
                "prepared keys of {} blocks for {} coded blocks",
                self.slots.len(),
                coded.encs.len()
            )));
        }
        Ok(())
    }

    /// Block `i`'s keys once prepared (waiting while they are being made), or None after
    /// taking the block for the caller to compute.
    pub(super) fn take(&self, i: usize) -> Option<&BlockKeys> {
        let slot = &self.slots[i];
        loop {
            match slot
                .state
                .compare_exchange(TODO, TAKEN, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) | Err(TAKEN) => return None,
                Err(DONE) => return slot.keys.get(),
                // One block in progress on another thread, which never waits on this one.
                Err(_) => std::thread::yield_now(),
            }
        }
    }
}

/// A block's [`BlockKeys`]: its keys as [`block_logits`](super::kernels::block_logits) makes them,
/// and every token's [`length`] for a token-norm scale (none from levels: their values are not
/// decoded).
#[inline(always)]
pub(super) fn prepare_block<const FMA: bool>(args: KeyArgs<'_>, out: &mut BlockKeys) {
    let (y, d, m, product, rot) = args;
    if !block_keys::<FMA>(y, d, m, product, rot, &mut out.keys) {
        out.keys.clear();
        out.keys.extend_from_slice(y.values());
    }
    out.keys.truncate(y.len());
    out.lengths = match y {
        Coords::Values(y) => y.chunks_exact(d).map(length::<FMA>).collect(),
        Coords::Levels(..) => Vec::new(), // no token norms read them
    };
}

/// `(prepared keys, head dim, norms, query rows)`.
pub(super) type PreparedArgs<'a> = (&'a BlockKeys, usize, Option<&'a [f32]>, Rows<'a>);

/// [`block_logits`](super::kernels::block_logits) of a block whose keys were prepared: the same
/// dots and scales.
#[inline(always)]
pub(super) fn prepared_logits<const FMA: bool>(args: PreparedArgs<'_>, out: &mut [f32]) {
    let (bk, d, norms, (q, chunks)) = args;
    let (n, g) = (bk.tokens(d), chunks.len());
    dots_rows::<FMA>(q, chunks, &bk.keys, out);
    if let Some(nm) = norms {
        for (t, &len) in bk.lengths.iter().enumerate() {
            let scale = nm[t] / len;
            for j in 0..g {
                out[j * n + t] *= scale;
            }
        }
    }
}

with_avx_fma! {
    /// [`prepare_block`], built with AVX + FMA where this CPU has them.
    pub(super) fn run_prepare_block(args: KeyArgs<'_>, out: &mut BlockKeys) => prepare_block
}

with_avx_fma! {
    /// [`prepared_logits`], built with AVX + FMA where this CPU has them.
    pub(super) fn run_prepared_logits(args: PreparedArgs<'_>, out: &mut [f32]) => prepared_logits
}
