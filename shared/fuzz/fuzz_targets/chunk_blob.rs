//! Fuzz target: `shared::fuzz::chunk_blob` must not panic on any input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| shared::fuzz::chunk_blob(data));
