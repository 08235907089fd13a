//! Serialises an encoded layer (see the module docs for the layout).

use half::{bf16, f16};

use super::codes::WireCode;
use super::layout::{FLAG_EXTERNAL_BASIS, FLAG_SHARED_BASIS, MAGIC};
use super::version::FORMAT_VERSION;
use crate::bitpack::{pack_into, BitWriter};
use crate::codec::block::{BlockBody, EncodedBlock};
use crate::kmeans::label_bits;
use crate::params::{CodecParams, InputDtype, SkeletonDtype};
use crate::pca::SharedBasis;
use crate::uniform::UniformBody;
use crate::waterfill::{coded_widths, WaterfillBody};
use crate::wht::padded_len;

fn put_u32(out: &mut Vec<u8>, v: usize) {
    out.extend_from_slice(&(v as u32).to_le_bytes());
}

fn put_skeleton(out: &mut Vec<u8>, vals: &[f32], dt: SkeletonDtype) {
    for &v in vals {
        match dt {
            SkeletonDtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            SkeletonDtype::Bf16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            SkeletonDtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
}

fn put_outliers(out: &mut Vec<u8>, outliers: &[(u32, f16)]) {
    for (pos, v) in outliers {
        out.extend_from_slice(&pos.to_le_bytes());
        out.extend_from_slice(&v.to_le_bytes());
    }
}

fn put_f16s(out: &mut Vec<u8>, vals: &[f16]) {
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// Writes a whole layer, checksum included. `external` is `(d_eff, fingerprint)` of a
/// caller-supplied basis.
pub fn write_layer(
    p: &CodecParams,
    n_tokens: usize,
    head_dim: usize,
    input_dtype: InputDtype,
    shared: Option<&SharedBasis>,
    external: Option<(usize, u64)>,
    blocks: &[EncodedBlock],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        super::layout::HEADER_LEN + blocks.iter().map(|b| b.n * 8).sum::<usize>(),
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    let mut flags: u16 = 0;
    if shared.is_some() {
        flags |= FLAG_SHARED_BASIS;
    }
    if external.is_some() {
        flags |= FLAG_EXTERNAL_BASIS;
    }
    out.extend_from_slice(&flags.to_le_bytes());
    put_u32(&mut out, n_tokens);
    put_u32(&mut out, head_dim);
    put_u32(&mut out, blocks.len());
    out.push(input_dtype.code());
    out.push(p.skeleton_dtype.code());
    out.push(p.bit_width);
    out.push(p.metric.code());
    out.push(p.pca_method.code());
    out.push(p.centroids.is_some() as u8);
    out.extend_from_slice(&0u16.to_le_bytes());
    put_u32(&mut out, p.block_size);
    out.extend_from_slice(&p.variance_ratio.to_le_bytes());
    put_u32(&mut out, p.rank_cap);
    put_u32(&mut out, p.k);
    put_u32(&mut out, p.kmeans_iters);
    put_u32(&mut out, p.target_rank);
    put_u32(&mut out, p.oversample);
    put_u32(&mut out, p.power_iters);
    out.extend_from_slice(&p.outlier_threshold.to_le_bytes());
    out.extend_from_slice(&p.seed.to_le_bytes());
    out.push(p.allocation.code());
    out.extend_from_slice(&[0u8; 3]);
    out.extend_from_slice(&p.bits_per_value.to_le_bytes());
    debug_assert_eq!(out.len(), super::layout::HEADER_LEN);
    if let Some(c) = &p.centroids {
        for v in c {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    if let Some(s) = shared {
        put_u32(&mut out, s.d_eff);
        put_skeleton(&mut out, &s.mean, p.skeleton_dtype);
        put_skeleton(&mut out, &s.basis, p.skeleton_dtype);
    }
    if let Some((d_eff, fp)) = external {
        put_u32(&mut out, d_eff);
        out.extend_from_slice(&fp.to_le_bytes());
    }
    for b in blocks {
        put_u32(&mut out, b.n);
        put_u32(&mut out, b.d_eff);
        put_u32(&mut out, b.body.k_used());
        put_u32(&mut out, b.body.outliers().len());
        put_u32(&mut out, b.body.kmeans_iters() as usize);
        if shared.is_none() {
            put_skeleton(&mut out, &b.mean, p.skeleton_dtype);
            put_skeleton(&mut out, &b.basis, p.skeleton_dtype); // empty when external
        }
        match &b.body {
            BlockBody::Uniform(u) => put_uniform(&mut out, u, b, p),
            BlockBody::Waterfill(w) => put_waterfill(&mut out, w),
        }
        put_outliers(&mut out, b.body.outliers());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Skeleton, scales and fixed-width codes (the outliers follow).
fn put_uniform(out: &mut Vec<u8>, u: &UniformBody, b: &EncodedBlock, p: &CodecParams) {
    let sk = &u.skeleton;
    put_skeleton(out, &sk.centres, p.skeleton_dtype);
    let lb = label_bits(sk.k_used);
    if lb > 0 {
        pack_into(&sk.labels, lb, out);
    }
    if sk.k_used > 0 {
        put_f16s(out, &sk.t);
    }
    put_f16s(out, &u.scales);
    debug_assert_eq!(u.codes.len(), b.n * padded_len(b.d_eff));
    pack_into(&u.codes, p.bit_width as u32, out);
}

/// Component scales and bits, then variable-width codes (the outliers follow).
fn put_waterfill(out: &mut Vec<u8>, w: &WaterfillBody) {
    put_f16s(out, &w.sigma);
    let nibbles: Vec<u16> = w.comp_bits.iter().map(|&v| v as u16).collect();
    pack_into(&nibbles, 4, out);
    let coded = coded_widths(&w.comp_bits);
    let mut bw = BitWriter::new();
    for (code, bits) in w.codes.iter().zip(coded.iter().cycle()) {
        bw.put(*code, *bits);
    }
    out.extend_from_slice(&bw.finish());
}
