//! Serialises an encoded layer (see the module docs for the layout).

use half::{bf16, f16};

use super::{FLAG_EXTERNAL_BASIS, FLAG_SHARED_BASIS, FORMAT_VERSION, MAGIC};
use crate::bitpack::{pack_into, BitWriter};
use crate::codec::{label_bits, EncodedBlock, SharedBasis};
use crate::params::{Allocation, CodecParams, InputDtype, Metric, PcaMethod, SkeletonDtype};
use crate::waterfill::coded_widths;
use crate::wht::padded_len;

pub(crate) fn dtype_code(d: InputDtype) -> u8 {
    match d {
        InputDtype::F32 => 0,
        InputDtype::F16 => 1,
        InputDtype::Bf16 => 2,
    }
}

pub(crate) fn skeleton_code(d: SkeletonDtype) -> u8 {
    match d {
        SkeletonDtype::F16 => 0,
        SkeletonDtype::Bf16 => 1,
        SkeletonDtype::F32 => 2,
    }
}

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
    let mut out =
        Vec::with_capacity(super::HEADER_LEN + blocks.iter().map(|b| b.n * 8).sum::<usize>());
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
    out.push(dtype_code(input_dtype));
    out.push(skeleton_code(p.skeleton_dtype));
    out.push(p.bit_width);
    out.push(match p.metric {
        Metric::Mse => 0,
        Metric::InnerProduct => 1,
    });
    out.push(match p.pca_method {
        PcaMethod::Exact => 0,
        PcaMethod::Randomized => 1,
        PcaMethod::None => 2,
    });
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
    out.push(match p.allocation {
        Allocation::Uniform => 0,
        Allocation::Waterfill => 1,
    });
    out.extend_from_slice(&[0u8; 3]);
    out.extend_from_slice(&p.bits_per_value.to_le_bytes());
    debug_assert_eq!(out.len(), super::HEADER_LEN);
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
        put_u32(&mut out, b.k_used);
        put_u32(&mut out, b.outliers.len());
        put_u32(&mut out, b.kmeans_iters as usize);
        if shared.is_none() {
            put_skeleton(&mut out, &b.mean, p.skeleton_dtype);
            put_skeleton(&mut out, &b.basis, p.skeleton_dtype); // empty when external
        }
        if p.allocation == Allocation::Waterfill {
            put_f16s(&mut out, &b.sigma);
            let nibbles: Vec<u16> = b.comp_bits.iter().map(|&v| v as u16).collect();
            pack_into(&nibbles, 4, &mut out);
            let coded = coded_widths(&b.comp_bits);
            let mut bw = BitWriter::new();
            for (code, bits) in b.codes.iter().zip(coded.iter().cycle()) {
                bw.put(*code, *bits);
            }
            out.extend_from_slice(&bw.finish());
            put_outliers(&mut out, &b.outliers);
            continue;
        }
        put_skeleton(&mut out, &b.centres, p.skeleton_dtype);
        let lb = label_bits(b.k_used);
        if lb > 0 {
            pack_into(&b.labels, lb, &mut out);
        }
        if b.k_used > 0 {
            put_f16s(&mut out, &b.t);
        }
        put_f16s(&mut out, &b.scales);
        debug_assert_eq!(b.codes.len(), b.n * padded_len(b.d_eff));
        pack_into(&b.codes, p.bit_width as u32, &mut out);
        put_outliers(&mut out, &b.outliers);
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}
