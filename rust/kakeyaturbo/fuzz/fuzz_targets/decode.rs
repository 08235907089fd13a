//! Feeds arbitrary bytes to the decoder. Contract under test: `EncodedLayer::from_bytes`
//! either fails with a format error or yields a layer that `decode_layer` decodes into
//! exactly `n_tokens * head_dim` finite values (or, for a layer that needs an external
//! basis, refuses with `Error::InvalidParams`); nothing ever panics.
//!
//! Every input is tried twice: as given, and with its last four bytes replaced by the
//! correct CRC-32 of the rest. Without the second pass almost every mutation would stop at
//! the checksum and the fuzzer would never reach the section parsers.
//!
//! Set `KAKEYATURBO_FUZZ_ALLOW_NONFINITE=1` to skip the finiteness check (to keep hunting
//! panics once a non-finite output has been found and reported).
#![no_main]

use std::sync::OnceLock;

use kakeyaturbo::{decode_layer, EncodedLayer, Error};
use libfuzzer_sys::fuzz_target;

fn allow_nonfinite() -> bool {
    static FLAG: OnceLock<bool> = OnceLock::new();
    *FLAG.get_or_init(|| {
        std::env::var_os("KAKEYATURBO_FUZZ_ALLOW_NONFINITE").is_some_and(|v| v == "1")
    })
}

fn check(bytes: Vec<u8>) {
    match EncodedLayer::from_bytes(bytes) {
        Err(e) => assert!(
            e.is_format_error(),
            "from_bytes failed with a non-format error: {e:?}"
        ),
        Ok(layer) => {
            let (n, d) = layer.shape();
            if layer.external_fingerprint().is_some() {
                // The basis is not in the bytes: decoding without it must refuse cleanly.
                let r = decode_layer(&layer);
                assert!(matches!(r, Err(Error::InvalidParams(_))), "{r:?}");
                return;
            }
            let out = decode_layer(&layer)
                .unwrap_or_else(|e| panic!("validated layer failed to decode: {e:?}"));
            assert_eq!(out.len(), n * d, "decoded length != n_tokens * head_dim");
            if !allow_nonfinite() {
                if let Some(i) = out.iter().position(|v| !v.is_finite()) {
                    panic!("non-finite decoded value {} at flat index {i}", out[i]);
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data.to_vec());
    if data.len() >= 8 {
        let mut fixed = data.to_vec();
        let body = fixed.len() - 4;
        let crc = crc32fast::hash(&fixed[..body]);
        fixed[body..].copy_from_slice(&crc.to_le_bytes());
        if fixed != data {
            check(fixed);
        }
    }
});
