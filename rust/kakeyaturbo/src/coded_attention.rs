//! Attention arithmetic over coded blocks, without a decoded copy of the layer.
//!
//! `KakeyaCache`'s attention (`python/kakeyaturbo/hf/coded_attention.py`) needs, per layer
//! and step, the logits of the queries against the coded keys and the attention-weighted sum
//! of the coded values. Decoding every block into one array and finishing in torch writes the
//! whole decoded layer to memory and reads it back once per pass (frame product, RoPE, logits;
//! norms, weighted sum). These kernels decode one block at a time into a scratch buffer that
//! stays in cache and finish the arithmetic there, blocks in parallel:
//!
//! - [`key_logits`]: `logit[s, j, t] = q[s, j] . rope_t(y_t M_h) * scale_t`: decode, frame
//!   product (one `[D, D]` matrix per head), RoPE on channel pairs `(i, i + pairs)` (the
//!   "rotate half" layout, so it runs over contiguous halves), a dot with every query row.
//! - [`value_sums`]: `out[s, j] = sum_t w[s, j, t] scale_t y_t`, still in frame coordinates
//!   (the caller applies the frame once per query row).
//!
//! `scale_t = norm_t / |y_t|` when the stream stores token norms (the decoded vector is a unit
//! direction whose length the quantiser shrank), 1 otherwise. Streams are stream-major lists of
//! encoded blocks ([`CodedStreams`]); stream `s` is row `s / heads`, head `s % heads`.
//!
//! The products are written so the compiler vectorises them (independent lanes, no float
//! reassociation needed) and are compiled twice: for the baseline target (SSE2 on x86-64,
//! what a portable wheel is built for) and, picked at run time, with AVX and FMA, whose dot
//! product is written with AVX intrinsics (the compiler's own was two lanes wide).
//!
//! The module's parts, one job each: the entry points (`api.rs`), what the key
//! kernel takes (`inputs.rs`), the coded streams' layout (`streams.rs`), shape checks
//! (`checks.rs`), the per-block kernels (`kernels.rs`), the float32 arithmetic and frame
//! product (`frame.rs`), the AVX intrinsics kernels (`avx.rs`), CPU feature detection and
//! dispatch (`cpu.rs`), per-thread scratch buffers (`scratch.rs`), the bfloat16 and int16
//! frame products (`bf16.rs`, `int16.rs`), token norms (`norms.rs`), keys made ahead of
//! attention (`prepared.rs`) and attention over joint and exact pieces (`attend.rs`).

mod api;
mod attend;
#[cfg(target_arch = "x86_64")]
mod avx;
mod bf16;
mod checks;
mod cpu;
mod frame;
mod inputs;
mod int16;
mod kernels;
mod norms;
mod prepared;
mod scratch;
mod streams;

pub use api::{key_logits, value_sums};
pub use attend::{attend, Attend, ExactPiece, Joint, Lanes};
pub use inputs::{bf16_products, int16_products, KeyInputs, Precision, RopeAngles};
pub use norms::{decode_codes as decode_norm_codes, Norms};
pub use prepared::PreparedKeys;
pub use streams::CodedStreams;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod prepared_tests;
