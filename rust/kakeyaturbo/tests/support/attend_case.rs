//! One attention case from fuzzer bytes, shared by the `attend` fuzz target
//! (`fuzz/fuzz_targets/attend.rs`) and its fixed-count replay (`tests/attend_replay.rs`).
//!
//! Bytes: four control bytes, then one encoded layer (its checksum recomputed, so that
//! mutations reach the parser), which every stream reads as its one key block and its one
//! value block. The control bytes pick the shapes, the exact lanes' kinds, the precision and
//! which optional inputs are given; the arrays are drawn from a generator they seed, finite
//! and in range (non-finite arrays are refused before the kernels, in
//! `rust/kakeyaturbo-py/src/finite.rs`).
//!
//! Contract: a blob `from_bytes` refuses is a format error; a layer with an external basis is
//! refused by `CodedStreams::new`; otherwise `attend`, `key_logits` and `value_sums` succeed
//! with outputs of their shapes, keys made ahead give the same bits, and where the decoded
//! values are moderate the outputs are finite and (float32 products) match a float64
//! reference computed from `decode_layer`'s output. Nothing panics.

use kakeyaturbo::coded_attention::{
    attend, key_logits, value_sums, Attend, CodedStreams, ExactPiece, KeyInputs, Lanes, Norms,
    Precision, PreparedKeys, RopeAngles,
};
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{decode_layer, int8_rows, EncodedLayer, Error};

/// Control bytes before the blob.
pub const CONTROL: usize = 4;
/// Decoded values per layer beyond which a case is skipped (time per execution).
const MAX_VALUES: usize = 1 << 14;
/// Largest decoded magnitude for which outputs must be finite and match the reference.
const MODERATE: f32 = 1e4;

/// What became of a case.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The blob was refused (format error, external basis, or too large to try).
    Refused,
    /// Every kernel ran and met the contract.
    Checked,
}

/// `blob` with its last four bytes replaced by the CRC-32 of the rest.
pub fn sealed(blob: &[u8]) -> Vec<u8> {
    let mut out = blob.to_vec();
    if out.len() >= 8 {
        let body = out.len() - 4;
        let crc = crc32fast::hash(&out[..body]);
        out[body..].copy_from_slice(&crc.to_le_bytes());
    }
    out
}

struct Case {
    streams: usize,
    rows: usize,
    exact: usize,
    bf16_keys: bool,
    int8_values: bool,
    flags: u8,
    precision: Precision,
    masks: bool,
    seed: u64,
}

impl Case {
    fn of(c: &[u8]) -> Self {
        Case {
            streams: 1 + (c[0] & 1) as usize,
            rows: 1 + ((c[0] >> 1) & 3) as usize,
            exact: ((c[0] >> 3) & 3) as usize,
            bf16_keys: c[0] & 0x20 != 0,
            int8_values: c[0] & 0x40 != 0,
            flags: c[1],
            precision: [Precision::F32, Precision::Bf16, Precision::I16][(c[2] % 3) as usize],
            masks: c[2] & 4 != 0,
            seed: u64::from(c[3]) | u64::from(c[2]) << 8,
        }
    }

    fn has(&self, bit: u8) -> bool {
        self.flags & (1 << bit) != 0
    }
}

/// Runs one case; panics where the contract fails.
pub fn check(data: &[u8]) -> Outcome {
    if data.len() < CONTROL {
        return Outcome::Refused;
    }
    let case = Case::of(&data[..CONTROL]);
    let layer = match EncodedLayer::from_bytes(sealed(&data[CONTROL..])) {
        Ok(layer) => layer,
        Err(e) => {
            assert!(e.is_format_error(), "from_bytes: not a format error: {e:?}");
            return Outcome::Refused;
        }
    };
    let (n, d) = layer.shape();
    let encs: Vec<&EncodedLayer> = vec![&layer; case.streams];
    if layer.external_fingerprint().is_some() {
        let r = CodedStreams::new(&encs, case.streams);
        assert!(
            matches!(r, Err(Error::InvalidParams(_))),
            "external basis: {:?}",
            r.err()
        );
        return Outcome::Refused;
    }
    if n == 0 || d == 0 || n * d > MAX_VALUES {
        return Outcome::Refused;
    }
    let y = decode_layer(&layer).unwrap_or_else(|e| panic!("a parsed layer failed: {e:?}"));
    let coded = CodedStreams::new(&encs, case.streams).expect("equal blocks");
    run(&case, &coded, &y, n, d);
    Outcome::Checked
}

/// The drawn inputs of a case.
struct Inputs {
    queries: Vec<f32>,
    key_frames: Option<Vec<f32>>,
    value_frames: Option<Vec<f32>>,
    key_norms: Option<Vec<f32>>,
    value_norms: Option<Vec<f32>>,
    rotation: Option<(Vec<f32>, usize)>,
    bias: Option<Vec<f32>>,
    softcap: Option<f32>,
    exact_keys: Vec<f32>,
    exact_values: Vec<f32>,
    scaling: f32,
}

fn draw(case: &Case, n: usize, d: usize) -> Inputs {
    let mut g = SplitMix64::new(case.seed, 0x4154_544E); // "ATTN"
    let mut normal = |len: usize, scale: f64| -> Vec<f32> {
        (0..len).map(|_| (g.normal() * scale) as f32).collect()
    };
    let (s, r, e) = (case.streams, case.rows, case.exact);
    let queries = normal(s * r * d, 1.0);
    let key_frames = case
        .has(0)
        .then(|| normal(s * d * d, (d as f64).powf(-0.5)));
    let value_frames = case
        .has(1)
        .then(|| normal(s * d * d, (d as f64).powf(-0.5)));
    let key_norms = case
        .has(2)
        .then(|| normal(s * n, 1.0).iter().map(|v| v.abs()).collect());
    let value_norms = case
        .has(3)
        .then(|| normal(s * n, 1.0).iter().map(|v| v.abs()).collect());
    let pairs = d / 2;
    let rotation = (case.has(6) && pairs > 0).then(|| {
        let angles = normal(n * pairs, 3.0);
        let mut table = vec![0.0f32; n * 2 * pairs];
        for t in 0..n {
            for i in 0..pairs {
                let a = angles[t * pairs + i];
                table[(t * 2) * pairs + i] = a.cos();
                table[(t * 2 + 1) * pairs + i] = a.sin();
            }
        }
        (table, pairs)
    });
    let mut bias = case.has(4).then(|| normal(s * r * (n + e), 1.0));
    if let (Some(b), true) = (bias.as_mut(), case.masks) {
        let mut m = SplitMix64::new(case.seed, 0x4D41_534B); // "MASK"
        b.iter_mut()
            .filter(|_| m.below(3) == 0)
            .for_each(|v| *v = f32::NEG_INFINITY);
    }
    let softcap = case.has(5).then_some(1.0 + (case.seed % 50) as f32);
    let mut exact_keys = normal(s * e * d, 1.0);
    if case.bf16_keys {
        exact_keys.iter_mut().for_each(|v| *v = bf16_round(*v));
    }
    let exact_values = normal(s * e * d, 2.0);
    Inputs {
        queries,
        key_frames,
        value_frames,
        key_norms,
        value_norms,
        rotation,
        bias,
        softcap,
        exact_keys,
        exact_values,
        scaling: (d as f32).powf(-0.5),
    }
}

fn bf16_round(v: f32) -> f32 {
    f32::from_bits(v.to_bits() & 0xFFFF_0000)
}

fn run(case: &Case, coded: &CodedStreams<'_>, y: &[f32], n: usize, d: usize) {
    let (s, r, e) = (case.streams, case.rows, case.exact);
    let x = draw(case, n, d);
    let bits: Vec<u16> = x
        .exact_keys
        .iter()
        .map(|v| (v.to_bits() >> 16) as u16)
        .collect();
    let rows8 = int8_rows::encode(&x.exact_values, d).expect("rows of d");
    let mut exact_values = Vec::new();
    int8_rows::decode_into(&rows8, d, &mut exact_values);
    let exact_values = if case.int8_values {
        exact_values
    } else {
        x.exact_values.clone()
    };
    let piece = ExactPiece {
        keys: if case.bf16_keys {
            Lanes::Bf16(&bits)
        } else {
            Lanes::F32(&x.exact_keys)
        },
        values: if case.int8_values {
            Lanes::Int8Rows(&rows8)
        } else {
            Lanes::F32(&exact_values)
        },
    };
    let rotation = x.rotation.as_ref().map(|(v, pairs)| RopeAngles {
        values: v,
        rows: 1,
        pairs: *pairs,
        repeats: 1,
    });
    let key_norms = x.key_norms.as_deref().map(Norms::Values);
    let value_norms = x.value_norms.as_deref().map(Norms::Values);
    let pieces = [piece];
    let a = Attend {
        queries: &x.queries,
        rows: r,
        key_frames: x.key_frames.as_deref().map(|m| (m, s)),
        rotation,
        key_norms,
        value_frames: x.value_frames.as_deref().map(|m| (m, s)),
        value_norms,
        exact: if e > 0 { &pieces } else { &[] },
        bias: x.bias.as_deref().map(|b| (b, s)),
        scaling: x.scaling,
        softcap: x.softcap,
        joint: None,
        precision: case.precision,
        prepared: None,
    };
    let out = attend(coded, coded, &a).unwrap_or_else(|err| panic!("attend: {err:?}"));
    assert_eq!(out.len(), s * r * d);
    if case.has(7) {
        let prepared = PreparedKeys::new(s);
        let keys = KeyInputs {
            frames: a.key_frames,
            rotation: a.rotation.as_ref(),
            precision: a.precision,
        };
        prepared
            .prepare(coded, &keys, a.key_norms.is_some())
            .expect("prepare");
        let ahead = Attend {
            prepared: Some(&prepared),
            rotation: a.rotation.as_ref().map(|r| RopeAngles { ..*r }),
            key_norms: x.key_norms.as_deref().map(Norms::Values),
            value_norms: x.value_norms.as_deref().map(Norms::Values),
            joint: None,
            ..a
        };
        let again = attend(coded, coded, &ahead).expect("attend with prepared keys");
        let same = out
            .iter()
            .zip(&again)
            .all(|(p, q)| p.to_bits() == q.to_bits());
        assert!(
            same,
            "prepared keys changed the result: {out:?} vs {again:?}"
        );
    }
    let logits = key_logits(
        coded,
        a.key_frames,
        a.rotation.as_ref(),
        a.key_norms.as_ref(),
        &x.queries,
        r,
        case.precision,
    )
    .unwrap_or_else(|err| panic!("key_logits: {err:?}"));
    assert_eq!(logits.len(), s * r * n);
    let weights: Vec<f32> = x.queries.iter().cycle().take(s * r * n).copied().collect();
    let sums = value_sums(coded, &weights, a.value_norms.as_ref(), r)
        .unwrap_or_else(|err| panic!("value_sums: {err:?}"));
    assert_eq!(sums.len(), s * r * d);
    if y.iter().any(|v| v.abs() > MODERATE) {
        return; // hostile but finite values: only shapes and no panic are promised
    }
    for (name, got) in [
        ("attend", &out),
        ("key_logits", &logits),
        ("value_sums", &sums),
    ] {
        if let Some(i) = got.iter().position(|v| !v.is_finite()) {
            panic!("{name}: non-finite output {} at {i}", got[i]);
        }
    }
    if case.precision != Precision::F32 {
        return; // rounded products: their own tests bound the error
    }
    let want = reference(case, &x, y, &exact_values, n, d);
    let tol = 1e-3 * (1.0 + want.values_max);
    close(
        "key_logits",
        &logits,
        &want.logits,
        1e-3 * (1.0 + want.logits_max),
    );
    let want_sums = reference_sums(&x, y, &weights, s, r, n, d);
    let sums_max = want_sums.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    close(
        "value_sums",
        &sums,
        &want_sums,
        1e-4 * (1.0 + sums_max) * n as f64,
    );
    if want.logits_max * f64::from(x.scaling) < 1e3 {
        close("attend", &out, &want.out, tol);
    }
}

fn close(name: &str, got: &[f32], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(*g) - w).abs();
        assert!(
            err <= tol,
            "{name}[{i}] = {g}, the reference {w} (tolerance {tol})"
        );
    }
}

/// Row vector `v` `[d]` times `m` `[d, d]` (None: the identity).
fn times(v: &[f64], m: Option<&[f32]>, d: usize) -> Vec<f64> {
    match m {
        None => v.to_vec(),
        Some(m) => (0..d)
            .map(|k| (0..d).map(|i| v[i] * f64::from(m[i * d + k])).sum())
            .collect(),
    }
}

/// `norm / max(|y|, 1e-12)` (None: 1), as the kernels scale a token.
fn token_scale(norms: Option<&[f32]>, at: usize, y: &[f64]) -> f64 {
    norms.map_or(1.0, |nm| {
        let len = y.iter().map(|v| v * v).sum::<f64>().sqrt();
        f64::from(nm[at]) / len.max(1e-12)
    })
}

struct Reference {
    logits: Vec<f64>,
    logits_max: f64,
    out: Vec<f64>,
    values_max: f64,
}

fn reference(case: &Case, x: &Inputs, y: &[f32], ev: &[f32], n: usize, d: usize) -> Reference {
    let (s_n, r, e) = (case.streams, case.rows, case.exact);
    let l = n + e;
    fn frame(m: &Option<Vec<f32>>, s: usize, d: usize) -> Option<&[f32]> {
        m.as_deref().map(|m| &m[s * d * d..][..d * d])
    }
    let mut logits = vec![0.0; s_n * r * n];
    let mut out = vec![0.0; s_n * r * d];
    let mut values_max = 0.0f64;
    for s in 0..s_n {
        // Stream s's keys and values, coded then exact, in the output's coordinates.
        let mut keys = Vec::with_capacity(l);
        let mut values = Vec::with_capacity(l);
        for t in 0..n {
            let yt: Vec<f64> = y[t * d..][..d].iter().map(|&v| f64::from(v)).collect();
            let mut k = times(&yt, frame(&x.key_frames, s, d), d);
            if let Some((table, p)) = &x.rotation {
                for i in 0..*p {
                    let c = f64::from(table[(t * 2) * p + i]);
                    let sn = f64::from(table[(t * 2 + 1) * p + i]);
                    let (a, b) = (k[i], k[i + p]);
                    k[i] = a * c - b * sn;
                    k[i + p] = a * sn + b * c;
                }
            }
            let ks = token_scale(x.key_norms.as_deref(), s * n + t, &yt);
            keys.push(k.iter().map(|v| v * ks).collect::<Vec<_>>());
            let vs = token_scale(x.value_norms.as_deref(), s * n + t, &yt);
            let v: Vec<f64> = yt.iter().map(|v| v * vs).collect();
            values.push(times(&v, frame(&x.value_frames, s, d), d));
        }
        for t in 0..e {
            let at = (s * e + t) * d;
            keys.push(
                x.exact_keys[at..][..d]
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect(),
            );
            values.push(ev[at..][..d].iter().map(|&v| f64::from(v)).collect());
        }
        for v in &values {
            values_max = v.iter().fold(values_max, |m, x| m.max(x.abs()));
        }
        for j in 0..r {
            let q: Vec<f64> = x.queries[(s * r + j) * d..][..d]
                .iter()
                .map(|&v| f64::from(v))
                .collect();
            let mut row: Vec<f64> = keys
                .iter()
                .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>())
                .collect();
            logits[(s * r + j) * n..][..n].copy_from_slice(&row[..n]);
            for (i, z) in row.iter_mut().enumerate() {
                *z *= f64::from(x.scaling);
                if let Some(c) = x.softcap {
                    let c = f64::from(c);
                    *z = (*z / c).tanh() * c;
                }
                if let Some(b) = &x.bias {
                    *z += f64::from(b[(s * r + j) * l + i]);
                }
            }
            let top = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
            if top == f64::NEG_INFINITY {
                continue; // every token masked: zeros
            }
            let w: Vec<f64> = row.iter().map(|z| (z - top).exp()).collect();
            let total: f64 = w.iter().sum();
            let o = &mut out[(s * r + j) * d..][..d];
            for (wi, v) in w.iter().zip(&values) {
                for (ok, vk) in o.iter_mut().zip(v) {
                    *ok += wi / total * vk;
                }
            }
        }
    }
    let logits_max = logits.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    Reference {
        logits,
        logits_max,
        out,
        values_max,
    }
}

/// `value_sums`' reference: `sum_t w[s, j, t] scale_t y_t`, in frame coordinates.
fn reference_sums(
    x: &Inputs,
    y: &[f32],
    w: &[f32],
    s_n: usize,
    r: usize,
    n: usize,
    d: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; s_n * r * d];
    for s in 0..s_n {
        for t in 0..n {
            let yt: Vec<f64> = y[t * d..][..d].iter().map(|&v| f64::from(v)).collect();
            let sc = token_scale(x.value_norms.as_deref(), s * n + t, &yt);
            for j in 0..r {
                let wt = f64::from(w[(s * r + j) * n + t]) * sc;
                for (o, v) in out[(s * r + j) * d..][..d].iter_mut().zip(&yt) {
                    *o += wt * v;
                }
            }
        }
    }
    out
}
