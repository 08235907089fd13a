//! Feeds control bytes and an encoded layer to the attention kernels (`attend`, with and
//! without keys made ahead, `key_logits`, `value_sums`). The case and its contract live in
//! `tests/support/attend_case.rs`, which `tests/attend_replay.rs` also runs on a fixed seeded
//! corpus in the normal test run.
#![no_main]

#[path = "../../tests/support/attend_case.rs"]
mod attend_case;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    attend_case::check(data);
});
