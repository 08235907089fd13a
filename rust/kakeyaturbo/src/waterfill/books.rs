//! What the water-filling encoder and decoder share: the widest a component's codes may be,
//! each width's Gaussian codebook and its inner-product gain.

use crate::lloyd_max::{self, gaussian_distortion, Codebook};

/// Largest number of bits one component may take.
pub const MAX_COMPONENT_BITS: u8 = 8;

/// Per-bit-width reconstruction gain: 1 for MSE; `1 / (1 - D(b))` for inner products,
/// which undoes the Lloyd-Max shrinkage `E[x x_hat] = (1 - D) E[x^2]` so that
/// `E[<x_hat, x>] = E[|x|^2]` component by component.
pub fn ip_gain(bits: u8) -> f32 {
    if bits == 0 {
        1.0
    } else {
        (1.0 / (1.0 - gaussian_distortion(bits))) as f32
    }
}

/// The Gaussian codebook of `bits` in 1..=8.
pub(crate) fn book(bits: u8) -> &'static Codebook {
    lloyd_max::gaussian(bits).expect("1..=8 bits")
}
