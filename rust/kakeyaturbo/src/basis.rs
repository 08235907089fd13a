//! Where a block's basis comes from: fitted per block, fitted once per layer, or supplied
//! by the caller.
//!
//! An external basis (e.g. a query-aware frame calibrated once per model and KV head) is
//! `d_eff` orthonormal rows of length `D`, checked as `|B B^T - I|_max <= 1e-3`. It is not
//! stored: an encoding holds only its 64-bit fingerprint, FNV-1a over `d_eff`, `D` (u64 LE)
//! and the rows' exact f32 bits, and decoding requires a basis with the same fingerprint.
//! Each block still stores its own (rounded) mean, so `x_hat_i = mean + B^T c_hat_i` as
//! with a fitted basis (see [`crate::pca`]).

use crate::error::{Error, Result};
use crate::kmeans::dot;
use crate::params::MAX_HEAD_DIM;
use crate::pca::SharedBasis;

/// Largest `|<row a, row b> - [a == b]|` accepted for an external basis.
const ORTHONORMAL_TOLERANCE: f32 = 1e-3;

/// A basis supplied by the caller (e.g. calibrated once per model and head): `d_eff`
/// orthonormal rows of length `head_dim`. Encodings store only its fingerprint.
#[derive(Debug, Clone, PartialEq)]
pub struct ExternalBasis {
    d_eff: usize,
    head_dim: usize,
    rows: Vec<f32>,
    fingerprint: u64,
}

/// FNV-1a 64 over the shape and the exact bits of the rows.
fn fingerprint(rows: &[f32], d_eff: usize, head_dim: usize) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &byte in bytes {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    eat(&(d_eff as u64).to_le_bytes());
    eat(&(head_dim as u64).to_le_bytes());
    for v in rows {
        eat(&v.to_le_bytes());
    }
    h
}

impl ExternalBasis {
    /// Validates shape, finiteness and orthonormality (`|B B^T - I|_max <= 1e-3`).
    pub fn new(rows: Vec<f32>, d_eff: usize, head_dim: usize) -> Result<Self> {
        if d_eff == 0 || head_dim == 0 || d_eff > head_dim || head_dim > MAX_HEAD_DIM {
            return Err(Error::Shape(format!(
                "basis must be [d_eff, head_dim] with 1 <= d_eff <= head_dim <= {MAX_HEAD_DIM}, got [{d_eff}, {head_dim}]"
            )));
        }
        if rows.len() != d_eff * head_dim {
            return Err(Error::Shape(format!(
                "basis holds {} values, expected {d_eff} x {head_dim}",
                rows.len()
            )));
        }
        if let Some(i) = rows.iter().position(|v| !v.is_finite()) {
            return Err(Error::InvalidParams(format!(
                "basis rows must be finite: row {}, column {} is {}",
                i / head_dim,
                i % head_dim,
                rows[i]
            )));
        }
        for a in 0..d_eff {
            for b in a..d_eff {
                let g = dot(
                    &rows[a * head_dim..(a + 1) * head_dim],
                    &rows[b * head_dim..(b + 1) * head_dim],
                );
                let want = if a == b { 1.0 } else { 0.0 };
                if (g - want).abs() > ORTHONORMAL_TOLERANCE {
                    return Err(Error::InvalidParams(format!(
                        "basis rows must be orthonormal: <row {a}, row {b}> = {g}"
                    )));
                }
            }
        }
        Ok(ExternalBasis {
            fingerprint: fingerprint(&rows, d_eff, head_dim),
            d_eff,
            head_dim,
            rows,
        })
    }
    /// Number of rows.
    pub fn d_eff(&self) -> usize {
        self.d_eff
    }
    /// Row length.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// The rows, row-major.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }
    /// 64-bit fingerprint stored in encodings that use this basis.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// The rows to decode a layer that declares `(d_eff, fingerprint)` of length `d`.
    pub(crate) fn rows_for(&self, d_eff: usize, fp: u64, d: usize) -> Result<&[f32]> {
        if self.fingerprint == fp && self.d_eff == d_eff && self.head_dim == d {
            Ok(&self.rows)
        } else {
            Err(Error::InvalidParams(format!(
                "basis mismatch: the layer was encoded with basis {fp:#018x}, got {:#018x}",
                self.fingerprint
            )))
        }
    }
}

/// Where a block's basis comes from.
#[derive(Debug, Clone, Copy)]
pub enum BasisRef<'a> {
    /// Fitted on the block and stored with it.
    PerBlock,
    /// Fitted once on the layer and stored once (`share_basis`).
    Shared(&'a SharedBasis),
    /// Supplied by the caller; only the block mean is stored.
    External(&'a ExternalBasis),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::EncodedLayer;
    use crate::codec::{decode_layer, decode_layer_with, encode_layer_with};
    use crate::params::InputDtype;
    use crate::stages::rel_err;
    use crate::test_data::{encode_f32, kv_like, waterfill};

    #[test]
    fn external_basis_is_not_stored_and_must_match() {
        let (n, d) = (1024, 32);
        let x = kv_like(n, d, 16);
        let fit = crate::pca::fit_exact(&x, n, d, None, 1.0, d).unwrap();
        let basis = ExternalBasis::new(fit.basis.clone(), d, d).unwrap();
        let p = waterfill(2.0);
        let with = encode_layer_with(&x, n, d, None, &p, InputDtype::F32, Some(&basis)).unwrap();
        let own = encode_f32(&x, n, d, &p);
        assert!(with.nbytes() + 2 * d * d * 2 - 12 - 200 <= own.nbytes());
        assert_eq!(with.external_fingerprint(), Some(basis.fingerprint()));
        assert!(matches!(decode_layer(&with), Err(Error::InvalidParams(_))));
        let mut other = fit.basis.clone();
        other.swap(0, d); // swap two entries: a different (non-orthonormal) basis is rejected
        assert!(ExternalBasis::new(other, d, d).is_err());
        let mut flipped = fit.basis.clone();
        flipped[..d].iter_mut().for_each(|v| *v = -*v);
        let wrong = ExternalBasis::new(flipped, d, d).unwrap();
        assert!(matches!(
            decode_layer_with(&with, Some(&wrong)),
            Err(Error::InvalidParams(_))
        ));
        let y = decode_layer_with(&with, Some(&basis)).unwrap();
        assert!(rel_err(&x, &y) < 0.15);
        let back = EncodedLayer::from_bytes(with.as_bytes().to_vec()).unwrap();
        assert_eq!(decode_layer_with(&back, Some(&basis)).unwrap(), y);
        assert!(ExternalBasis::new(vec![1.0; 4], 2, 2).is_err());
    }

    #[test]
    fn non_finite_rows_are_located() {
        let mut rows = vec![1.0, 0.0, 0.0, 1.0];
        rows[3] = f32::NAN;
        let msg = ExternalBasis::new(rows, 2, 2).unwrap_err().to_string();
        assert!(msg.contains("row 1, column 1 is NaN"), "{msg}");
    }
}
