//! The listeners' exposition (as a processor or controller serves it on `/metrics`) under
//! `promtool check metrics`, with every series present: a known depth, an open breaker, a
//! dependency down, handling observed. Skipped without promtool (see fleet-test-support's
//! `promtool`); deploy/e2e/tests/compose.rs checks the running services' own.

use crate::state::ListenerState;

/// A listener with every optional series set: a depth looked at, S3's breaker open.
pub(crate) fn busy_state(queue: &str) -> ListenerState {
    serde_json::from_value(serde_json::json!({
        "queue": queue,
        "depth": { "visible": 40, "in_flight": 12, "delayed": 0 },
        "depth_age_ms": 900,
        "consumers_active": 2, "consumers_total": 3, "consumers_parked": 1, "consumers_min": 1, "consumers_max": 4,
        "concurrency_in_use": 8, "concurrency_limit": 16, "buffer_len": 4, "buffer_capacity": 32, "ttl_ms": 60000,
        "in_hand": 12, "pending_deletes": 3, "pending_visibility_changes": 0,
        "receives": 120, "empty_receives": 7, "received": 300, "processed": 280, "failed": 2, "expired": 1, "evicted": 0, "extended": 45,
        "paused_for": ["S3"], "held": 5, "held_total": 9, "paused_total": 2,
        "breakers": [
            { "dependency": "S3", "open": true, "open_for_s": 12.5, "failures": 6, "trips": 1, "probes": 3, "last_error": "GetObject: timeout" },
            { "dependency": "SQS", "open": false, "open_for_s": 0.0, "failures": 0, "trips": 0, "probes": 0, "last_error": null }
        ]
    }))
    .expect("a listener state")
}

#[test]
fn the_listeners_exposition_is_clean_under_promtool() {
    crate::metrics::observe_handling("work-lint", 3, 0.02);
    let m = crate::http::render_metrics(&[busy_state("work-lint"), busy_state("results-lint")]);
    for name in ["listener_consumers", "listener_breaker_open", "listener_dependency_down", "listener_handling_seconds_bucket", "listener_received_total"] {
        assert!(fleet_test_support::promtool::metric_names(&m).contains(name), "{name} missing:\n{m}");
    }
    fleet_test_support::promtool::assert_clean("the listeners' /metrics", &m);
    // And nothing at all (a service before its first listener): still clean.
    fleet_test_support::promtool::assert_clean("/metrics without listeners", &crate::http::render_metrics(&[]));
}
