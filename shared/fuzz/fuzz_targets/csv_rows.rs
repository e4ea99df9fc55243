//! Fuzz target: `shared::fuzz::csv_rows` must not panic on any input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| shared::fuzz::csv_rows(data));
