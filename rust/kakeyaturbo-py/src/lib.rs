//! Python bindings for the kakeyaturbo codec (`kakeyaturbo._core`). Bindings only: every
//! algorithm lives in the `kakeyaturbo` crate.

mod arrays;
mod attention;
mod codec;
mod errors;
mod finite;
mod int8_rows;
mod openmp;
mod params;
mod prepared;
mod workers;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", kakeyaturbo::format::FORMAT_VERSION)?;
    m.add_class::<params::PyCodecParams>()?;
    m.add_class::<codec::PyEncodedLayer>()?;
    m.add_class::<codec::PyBasis>()?;
    m.add_class::<prepared::PyPreparedKeys>()?;
    m.add_function(wrap_pyfunction!(params::_params_from_dict, m)?)?;
    m.add_function(wrap_pyfunction!(params::codec_params_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(codec::encode_layer, m)?)?;
    m.add_function(wrap_pyfunction!(codec::encode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(codec::decode_layer, m)?)?;
    m.add_function(wrap_pyfunction!(codec::decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(codec::stage_errors, m)?)?;
    m.add_function(wrap_pyfunction!(attention::coded_key_logits, m)?)?;
    m.add_function(wrap_pyfunction!(attention::coded_value_sums, m)?)?;
    m.add_function(wrap_pyfunction!(attention::coded_attend, m)?)?;
    m.add_function(wrap_pyfunction!(attention::decode_norm_codes, m)?)?;
    m.add_function(wrap_pyfunction!(attention::bf16_products, m)?)?;
    m.add_function(wrap_pyfunction!(attention::int16_products, m)?)?;
    m.add_function(wrap_pyfunction!(prepared::prepare_keys, m)?)?;
    m.add_function(wrap_pyfunction!(int8_rows::int8_rows_encode, m)?)?;
    m.add_function(wrap_pyfunction!(codec::gaussian_codebook, m)?)?;
    m.add_function(wrap_pyfunction!(codec::gaussian_distortions, m)?)?;
    m.add_function(wrap_pyfunction!(codec::fit_codebook, m)?)?;
    m.add_function(wrap_pyfunction!(codec::wht_rotate, m)?)?;
    m.add_function(wrap_pyfunction!(codec::waterfill_sections, m)?)?;
    m.add_function(wrap_pyfunction!(workers::share_torch_threads, m)?)?;
    workers::follow_wait_policy();
    m.add_function(wrap_pyfunction!(workers::_workers, m)?)?;
    m.add(
        "KakeyaTurboError",
        py.get_type::<errors::KakeyaTurboError>(),
    )?;
    m.add("FormatError", py.get_type::<errors::FormatError>())?;
    m.add("ChecksumError", py.get_type::<errors::ChecksumError>())?;
    m.add(
        "UnsupportedVersionError",
        py.get_type::<errors::UnsupportedVersionError>(),
    )?;
    m.add(
        "__all__",
        [
            "Basis",
            "ChecksumError",
            "CodecParams",
            "EncodedLayer",
            "FORMAT_VERSION",
            "FormatError",
            "KakeyaTurboError",
            "PreparedKeys",
            "UnsupportedVersionError",
            "codec_params_defaults",
            "bf16_products",
            "coded_attend",
            "coded_key_logits",
            "coded_value_sums",
            "decode_batch",
            "decode_layer",
            "decode_norm_codes",
            "encode_batch",
            "encode_layer",
            "int16_products",
            "int8_rows_encode",
            "fit_codebook",
            "gaussian_codebook",
            "gaussian_distortions",
            "prepare_keys",
            "share_torch_threads",
            "stage_errors",
            "wht_rotate",
        ],
    )?;
    Ok(())
}
