//! What the key kernel takes besides the codes: the frame product's [`Precision`], the
//! frames and RoPE's angles ([`KeyInputs`], [`RopeAngles`]), and their checks.

use super::checks::{check_frames, check_len, frame_of};
use super::streams::CodedStreams;
use super::{bf16, int16};
use crate::error::{Error, Result};

/// The arithmetic of [`key_logits`](super::key_logits)' frame product, its costliest part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// float32 products and sums.
    #[default]
    F32,
    /// The coordinates less their block mean, and the frame, rounded to bfloat16 (to nearest
    /// even); the mean's product and all sums in float32: twice the rate where the CPU
    /// multiplies bfloat16 pairs natively (AVX512-BF16) and the head dim is a multiple of 16;
    /// float32 everywhere else (`bf16.rs`, [`bf16_products`]).
    Bf16,
    /// The coordinates less their block mean, and the frame, as 16-bit integers with scales
    /// per block (11-13 bits of each), exact int32 sums, the mean's product in float32: twice
    /// the float32 rate where the CPU has AVX512-VNNI, the same bits with AVX2 (about 1.55x
    /// the float32 peak on a Zen 3), where the head dim is a multiple of 16; float32 elsewhere
    /// (`int16.rs`, [`int16_products`]).
    I16,
}

/// Whether [`Precision::Bf16`] multiplies in bfloat16 on this CPU for head dim `d` (else it
/// runs the float32 product).
pub fn bf16_products(d: usize) -> bool {
    bf16::available() && bf16::fits(d)
}

/// Whether [`Precision::I16`] multiplies in 16-bit integers on this CPU for head dim `d` (else
/// it runs the float32 product).
pub fn int16_products(d: usize) -> bool {
    int16::available() && int16::fits(d)
}

/// How one block's frame product runs ([`Precision`] as this CPU takes it).
#[derive(Clone, Copy)]
pub(super) enum Product<'a> {
    F32,
    /// The frame as bfloat16 pairs ([`bf16::pack_pairs`]).
    Bf16(&'a [u32]),
    I16,
}

/// The RoPE rotation of [`key_logits`](super::key_logits): at every coded token the cosines, then
/// the sines, of the angles of channel pairs `(i, i + P)`, `[rows, tokens, 2, pairs]` (`rows` 1:
/// shared by every row), `P = pairs * repeats`: pair `i` turns by angle `i % pairs`. Keys coded
/// across heads lay every head's pairs side by side, each with the same angles, so the table holds
/// one head's (a third of the memory each key block reads with three heads).
pub struct RopeAngles<'a> {
    pub values: &'a [f32],
    pub rows: usize,
    pub pairs: usize,
    /// How many times the angles repeat across the channel pairs (at least 1).
    pub repeats: usize,
}

impl RopeAngles<'_> {
    /// Channel pairs turned: `pairs * repeats`.
    pub(super) fn turned(&self) -> usize {
        self.pairs.saturating_mul(self.repeats)
    }
}

/// What makes a coded block's keys besides its codes: the frames, RoPE's rotation and the frame
/// product's arithmetic (as [`key_logits`](super::key_logits) takes them).
#[derive(Clone, Copy)]
pub struct KeyInputs<'a> {
    pub frames: Option<(&'a [f32], usize)>,
    pub rotation: Option<&'a RopeAngles<'a>>,
    pub precision: Precision,
}

impl KeyInputs<'_> {
    /// Checks the frames and the rotation against `coded`.
    pub fn check(&self, coded: &CodedStreams<'_>) -> Result<()> {
        let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
        check_frames("frames", self.frames, s_n, d, d)?;
        if let Some(r) = self.rotation {
            let bad_rows = r.rows == 0 || (r.rows != 1 && r.rows * (s_n / r.rows) != s_n);
            if r.repeats == 0 || r.turned() > d / 2 || bad_rows {
                return Err(Error::Shape(format!(
                    "rotation: {} rows of {} pairs repeated {} times for {s_n} streams of \
                     head dim {d}",
                    r.rows, r.pairs, r.repeats
                )));
            }
            check_len(
                "rotation",
                r.values.len(),
                &[r.rows, t_n, 2, r.pairs],
                "rows x tokens x 2 x pairs",
            )?;
        }
        Ok(())
    }

    /// The frame product's form on this CPU: the frames as bfloat16 pairs when they are
    /// multiplied so (once per call: a few microseconds for 192 x 192), or whether in int16.
    pub(super) fn products(&self, d: usize) -> Products {
        Products {
            pairs: self
                .frames
                .filter(|_| self.precision == Precision::Bf16 && bf16_products(d))
                .map(|(m, heads)| (bf16::pack_pairs(m, d), heads)),
            int16: self.precision == Precision::I16 && int16_products(d),
        }
    }

    /// Whether blocks go to the int16 product as levels decoded straight from their codes
    /// ([`int16::Grid`]): where the frames are multiplied in int16 and nothing needs the
    /// decoded values themselves (`values_unneeded`: no token norms, which divide by `|y_t|`).
    pub(super) fn levels(&self, products: &Products, values_unneeded: bool) -> bool {
        products.int16 && self.frames.is_some() && values_unneeded
    }

    /// Block `(s, b)`'s arguments of [`block_keys`](super::kernels::block_keys): its frame and
    /// RoPE's angles of its tokens.
    pub(super) fn block<'p>(
        &'p self,
        coded: &CodedStreams<'_>,
        products: &'p Products,
        s: usize,
        b: usize,
    ) -> BlockInputs<'p> {
        let (s_n, t_n, d) = (coded.streams, coded.tokens(), coded.d);
        let (t0, n) = (coded.offsets[b], coded.offsets[b + 1] - coded.offsets[b]);
        let product = match &products.pairs {
            Some((p, heads)) => Product::Bf16(&p[(s % heads) * d * d / 2..][..d * d / 2]),
            None if products.int16 => Product::I16,
            None => Product::F32,
        };
        let rot = self.rotation.map(|r| {
            let row = if r.rows == 1 { 0 } else { s / (s_n / r.rows) };
            let w = 2 * r.pairs;
            (
                &r.values[(row * t_n + t0) * w..][..n * w],
                r.pairs,
                r.repeats,
            )
        });
        (frame_of(self.frames, s, d), product, rot)
    }
}

/// RoPE's angles of a block's tokens, `[n, 2, pairs]`, their pairs and repeats
/// ([`RopeAngles`]).
pub(super) type BlockAngles<'a> = (&'a [f32], usize, usize);

/// One block's frame, how its product runs, and RoPE's angles of its tokens.
pub(super) type BlockInputs<'a> = (Option<&'a [f32]>, Product<'a>, Option<BlockAngles<'a>>);

/// [`KeyInputs::products`].
pub(super) struct Products {
    pub(super) pairs: Option<(Vec<u32>, usize)>,
    pub(super) int16: bool,
}
