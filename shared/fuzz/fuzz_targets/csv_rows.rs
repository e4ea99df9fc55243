//! Fuzz target: `fleet_domain::fuzz::csv_rows` must not panic on any input.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| fleet_domain::fuzz::csv_rows(data));
