//! No library: this package holds the fleet's end-to-end tests (`tests/it`, `tests/compose`).
