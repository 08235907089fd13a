//! Shape checks shared by the attention entry points.

use crate::error::{Error, Result};

/// `got` must be the product of `dims` (checked: a zero-sized array may declare dims whose
/// product overflows).
pub(super) fn check_len(name: &str, got: usize, dims: &[usize], shape: &str) -> Result<()> {
    match dims.iter().try_fold(1usize, |p, &x| p.checked_mul(x)) {
        Some(want) if want == got => Ok(()),
        want => Err(Error::Shape(format!(
            "{name}: {got} values, expected {} ({shape} = {dims:?})",
            want.map_or("more than fit in memory".into(), |w| w.to_string())
        ))),
    }
}

/// Per-head frames `[heads, rows, cols]` (with `heads`) must split `streams` streams (or
/// heads) into equal groups and hold `heads` matrices of `rows x cols`.
pub(super) fn check_frames(
    name: &str,
    frames: Option<(&[f32], usize)>,
    streams: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let Some((m, heads)) = frames else {
        return Ok(());
    };
    if heads == 0 || !streams.is_multiple_of(heads) {
        return Err(Error::Shape(format!(
            "{name}: {streams} streams do not group over {heads} heads"
        )));
    }
    check_len(
        name,
        m.len(),
        &[heads, rows, cols],
        "heads x coordinates x head_dim",
    )
}

/// Stream `s`'s frame (head `s % heads`), after [`check_frames`].
pub(super) fn frame_of(frames: Option<(&[f32], usize)>, s: usize, d: usize) -> Option<&[f32]> {
    frames.map(|(m, heads)| &m[(s % heads) * d * d..][..d * d])
}
