//! `prepare_keys`: a layer's coded keys made ahead of its attention, on a worker the codec's
//! pool leaves idle while torch runs the model on one thread (`kakeyaturbo::coded_attention::
//! PreparedKeys`). `coded_attend(..., prepared=...)` then reads them.

use std::sync::Arc;

use kakeyaturbo::coded_attention::{self as core, CodedStreams, KeyInputs, Precision, RopeAngles};
use kakeyaturbo::EncodedLayer;
use numpy::PyUntypedArrayMethods;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::codec::PyEncodedLayer;
use crate::errors::{to_py, to_py_in};
use crate::finite::opt_finite_array;
use crate::params::precision_arg;
use crate::workers;

/// A float32 array as `prepare_keys` took it: kept alive while a worker reads its memory
/// without the GIL (no copy of it made per layer and step).
struct Held {
    _owner: Py<PyAny>,
    values: *const f32,
    len: usize,
}

// SAFETY: `values` points into the float32 buffer of the array `_owner` holds a reference to,
// so it stays allocated while this lives; it is only read, and `prepare_keys` documents that
// the caller does not write to the array while the prepared keys live.
#[allow(unsafe_code)]
unsafe impl Send for Held {}
#[allow(unsafe_code)]
unsafe impl Sync for Held {}

impl Held {
    fn of(owner: &Bound<'_, PyAny>, values: &[f32]) -> Self {
        Self {
            _owner: owner.clone().unbind(),
            values: values.as_ptr(),
            len: values.len(),
        }
    }

    fn values(&self) -> &[f32] {
        // SAFETY: see the `Send` impl: `len` floats from `values`, alive while `self` is.
        #[allow(unsafe_code)]
        unsafe {
            std::slice::from_raw_parts(self.values, self.len)
        }
    }

    /// Whether `other` is this array's memory.
    fn is(&self, other: &[f32]) -> bool {
        std::ptr::eq(self.values, other.as_ptr()) && self.len == other.len()
    }

    /// Whether `other` holds this array's values: the same memory, or else equal values.
    fn equals(&self, other: &[f32]) -> bool {
        self.is(other) || self.values() == other
    }
}

/// RoPE's rotation as `prepare_keys` took it.
struct HeldRotation {
    values: Held,
    rows: usize,
    pairs: usize,
    repeats: usize,
}

impl HeldRotation {
    fn angles(&self) -> RopeAngles<'_> {
        RopeAngles {
            values: self.values.values(),
            rows: self.rows,
            pairs: self.pairs,
            repeats: self.repeats,
        }
    }
}

/// What the keys were made from: the blocks, the frames and their heads, the rotation (both
/// held), the precision.
struct Inputs {
    encs: Vec<Py<PyEncodedLayer>>,
    streams: usize,
    frames: Option<(Held, usize)>,
    rotation: Option<HeldRotation>,
    precision: Precision,
    token_norms: bool,
}

impl Inputs {
    fn layers(&self) -> Vec<&EncodedLayer> {
        // Frozen and `Sync`: readable without the GIL.
        self.encs.iter().map(|e| &e.get().inner).collect()
    }

    /// Makes the keys into `keys` (with the GIL released, on the calling thread alone).
    fn prepare(&self, keys: &core::PreparedKeys) -> kakeyaturbo::Result<usize> {
        let layers = self.layers();
        let coded = CodedStreams::new(&layers, self.streams)?;
        let rotation = self.rotation.as_ref().map(HeldRotation::angles);
        let inputs = KeyInputs {
            frames: self.frames.as_ref().map(|(m, h)| (m.values(), *h)),
            rotation: rotation.as_ref(),
            precision: self.precision,
        };
        keys.prepare(&coded, &inputs, self.token_norms)
    }
}

/// A layer's coded keys made ahead of its attention (`prepare_keys`); pass it to
/// `coded_attend(..., prepared=...)` with the same blocks, key frames, rotation and precision.
/// Transient: dropping it stops a preparation still running.
#[pyclass(name = "PreparedKeys", module = "kakeyaturbo._core", frozen)]
pub struct PyPreparedKeys {
    keys: Arc<core::PreparedKeys>,
    inputs: Arc<Inputs>,
}

#[pymethods]
impl PyPreparedKeys {
    /// Blocks whose keys are made so far.
    fn prepared(&self) -> usize {
        self.keys.prepared()
    }

    fn __len__(&self) -> usize {
        self.inputs.encs.len()
    }
}

impl Drop for PyPreparedKeys {
    fn drop(&mut self) {
        self.keys.cancel();
    }
}

impl PyPreparedKeys {
    /// The prepared keys, after checking they were made from exactly these inputs of
    /// `coded_attend`: the same block objects, frames of equal values (the same array is
    /// not read again), the same rotation array, the same precision. A ValueError names the
    /// first that differs.
    pub fn matching(
        &self,
        layers: &[&EncodedLayer],
        streams: usize,
        frames: Option<(&[f32], usize)>,
        rotation: Option<&RopeAngles<'_>>,
        precision: Precision,
    ) -> PyResult<&core::PreparedKeys> {
        let own = &self.inputs;
        let fail = |what: &str| {
            Err(PyValueError::new_err(format!(
                "prepared: the keys were made with other {what} than this call's"
            )))
        };
        let same_blocks = own.streams == streams
            && own.encs.len() == layers.len()
            && own
                .encs
                .iter()
                .zip(layers)
                .all(|(e, l)| std::ptr::eq(&e.get().inner, *l));
        if !same_blocks {
            return fail("key blocks");
        }
        let same_frames = match (&own.frames, frames) {
            (None, None) => true,
            (Some((m, heads)), Some((f, fh))) => *heads == fh && m.equals(f),
            _ => false,
        };
        if !same_frames {
            return fail("key_frames");
        }
        let same_rotation = match (&own.rotation, rotation) {
            (None, None) => true,
            (Some(h), Some(r)) => {
                h.values.is(r.values)
                    && (h.rows, h.pairs, h.repeats) == (r.rows, r.pairs, r.repeats)
            }
            _ => false,
        };
        if !same_rotation {
            return fail("rotation (the same array is required)");
        }
        if own.precision != precision {
            return fail("precision");
        }
        Ok(&self.keys)
    }
}

/// Makes the keys of the blocks `key_encs` (laid out as for `coded_attend`) with `key_frames`,
/// `rotation` (`rotation_repeats`) and `precision` as `coded_attend` will take them: decoding,
/// the frame product and RoPE, everything of the key logits that does not need the queries.
///
/// With `background` (the default) it runs on a worker of the codec's pool while the caller
/// goes on, and returns None where there is no idle worker to run it: when the codec runs on
/// torch's threads (torch with more than one) or its pool has one thread. Attention then
/// computes the blocks not yet made itself, so the result is the same bits either way. Without
/// it, every block is made before it returns. The caller must not write to `key_frames` or
/// `rotation` while the returned keys live (their memory is read in place); `coded_attend`
/// takes the same rotation array and frames of equal values.
///
/// `token_norms`: whether `coded_attend` will scale these keys by token norms (`key_norms`),
/// which need each token's decoded length. Without them an int16 product decodes its levels
/// straight from the codes and skips the values; given norms, `coded_attend` then makes such
/// blocks again itself (the same bits, the time spent twice).
#[pyfunction]
#[pyo3(signature = (key_encs, streams, key_frames=None, rotation=None, precision="float32",
    background=true, rotation_repeats=1, token_norms=false))]
#[allow(clippy::too_many_arguments)]
pub fn prepare_keys<'py>(
    py: Python<'py>,
    key_encs: Vec<Bound<'py, PyEncodedLayer>>,
    streams: usize,
    key_frames: Option<&Bound<'py, PyAny>>,
    rotation: Option<&Bound<'py, PyAny>>,
    precision: &str,
    background: bool,
    rotation_repeats: usize,
    token_norms: bool,
) -> PyResult<Option<PyPreparedKeys>> {
    let precision = precision_arg(precision)?;
    let frames = match (
        key_frames,
        opt_finite_array::<numpy::Ix3>(key_frames, "key_frames", false)?,
    ) {
        (Some(owner), Some(a)) => Some((Held::of(owner, a.as_slice()?), a.shape()[0])),
        _ => None,
    };
    let rotation = match (
        rotation,
        opt_finite_array::<numpy::Ix4>(rotation, "rotation", false)?,
    ) {
        (Some(owner), Some(a)) => Some(HeldRotation {
            values: Held::of(owner, a.as_slice()?),
            rows: a.shape()[0],
            pairs: a.shape()[3],
            repeats: rotation_repeats,
        }),
        _ => None,
    };
    let inputs = Arc::new(Inputs {
        encs: key_encs.iter().map(|e| e.clone().unbind()).collect(),
        streams,
        frames,
        rotation,
        precision,
        token_norms,
    });
    // Checked here, so that bad input raises in the caller rather than on a worker.
    let layers = inputs.layers();
    let coded = CodedStreams::new(&layers, streams).map_err(|e| to_py_in("key_encs", e))?;
    let held_rotation = inputs.rotation.as_ref().map(HeldRotation::angles);
    KeyInputs {
        frames: inputs.frames.as_ref().map(|(m, h)| (m.values(), *h)),
        rotation: held_rotation.as_ref(),
        precision,
    }
    .check(&coded)
    .map_err(to_py)?;
    let keys = Arc::new(core::PreparedKeys::new(layers.len()));
    if background {
        let (k, i) = (Arc::clone(&keys), Arc::clone(&inputs));
        // An error is left to attention, which computes that block itself and raises it.
        if !workers::spawn(move || drop(i.prepare(&k))) {
            return Ok(None);
        }
    } else {
        let i = Arc::clone(&inputs);
        workers::detach(py, || i.prepare(&keys)).map_err(to_py)?;
    }
    Ok(Some(PyPreparedKeys { keys, inputs }))
}
