//! One encoded block as the encoder makes it and the wire format writes it: its mean, basis
//! and coded body.

use half::f16;

use crate::uniform::UniformBody;
use crate::waterfill::WaterfillBody;

/// One encoded block, with its codes unpacked (the wire form packs them).
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedBlock {
    /// Vectors in the block.
    pub n: usize,
    /// Kept PCA components.
    pub d_eff: usize,
    /// Block mean (empty with a shared basis).
    pub mean: Vec<f32>,
    /// Block basis rows (empty with a shared or external basis, or `pca_method = none`).
    pub basis: Vec<f32>,
    /// The coded coefficients; the variant follows the layer's
    /// [`Allocation`](crate::params::Allocation).
    pub body: BlockBody,
}

/// How a block's coefficients are coded.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockBody {
    /// Skeleton, rotation and `bit_width` bits per rotated coordinate.
    Uniform(UniformBody),
    /// Bits per PCA component by reverse water-filling.
    Waterfill(WaterfillBody),
}

impl BlockBody {
    /// k-means centres stored (0 for water-filled blocks).
    pub fn k_used(&self) -> usize {
        match self {
            BlockBody::Uniform(u) => u.skeleton.k_used,
            BlockBody::Waterfill(_) => 0,
        }
    }
    /// k-means iterations run (0 for water-filled blocks).
    pub fn kmeans_iters(&self) -> u32 {
        match self {
            BlockBody::Uniform(u) => u.skeleton.iters,
            BlockBody::Waterfill(_) => 0,
        }
    }
    /// Exactly stored coordinates, `(flat position, value)`, positions ascending.
    pub fn outliers(&self) -> &[(u32, f16)] {
        match self {
            BlockBody::Uniform(u) => &u.outliers,
            BlockBody::Waterfill(w) => &w.outliers,
        }
    }
}
