//! Fuzz target: `shared::fuzz::work_item` must not panic on any input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| shared::fuzz::work_item(data));
