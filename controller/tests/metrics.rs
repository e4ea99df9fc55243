//! The controller's `/metrics` (its listeners' series and its own, `controller/src/events.rs`) under
//! `promtool check metrics`, after the events that make every series of its own appear: a job finished
//! partial, a message quarantined and one refused, a checkpoint written, results applied, a partition
//! gained. Skipped without promtool (fleet-test-support's `promtool`); deploy/e2e/tests/compose.rs
//! checks the running controller's own.

use std::time::Duration;

use controller::events;
use fleet_domain::model::{FailedChunk, JobStatus};
use fleet_test_support::promtool;

#[test]
fn the_controllers_exposition_is_clean_under_promtool() {
    events::register_metrics();
    // Before any event: the series of a known label value are there at 0.
    let m = fleet_engine::http::render_metrics(&[]);
    for series in [r#"controller_jobs_finished_total{status="partial"} 0"#, r#"controller_messages_refused_total{why="contradicts"} 0"#] {
        assert!(m.contains(series), "{series} missing at the start:\n{m}");
    }
    promtool::assert_clean("the controller's /metrics at its start", &m);

    let failed = [FailedChunk { lines: Vec::new(), chunk: 3, transactions: 10, reason: "corrupt".into() }];
    events::JobFinished {
        job: "j1",
        status: JobStatus::Partial,
        processed: 90,
        failed: 10,
        duplicates: 0,
        requests: 12,
        latency: Some(Duration::from_secs(7)),
        total_chunks: Some(4),
        failed_chunks: &failed,
        note: None,
    }
    .emit();
    events::MessageQuarantined { queue: "billing-results", message_id: "m1", key: "quarantine/m1", reason: "unreadable" }.emit();
    events::MessageRefused { job: "j1", message_id: "m2", reason: "contradicts", recorded: true }.emit();
    events::CheckpointWritten { job: "j1", part_bytes: 4096, took: Duration::from_millis(30) }.emit();
    events::ResultsApplied { open_jobs: 2 }.emit();
    events::PartitionChanged { owner: "c1", partition: 0, owned: true }.emit();
    let m = fleet_engine::http::render_metrics(&[]);
    let names = promtool::metric_names(&m);
    for name in [
        "controller_jobs_finished_total",
        "controller_messages_quarantined_total",
        "controller_open_jobs",
        "controller_last_result_timestamp_seconds",
        "controller_job_latency_seconds_bucket",
        "controller_checkpoint_part_bytes_total",
        "fleet_build_info",
    ] {
        assert!(names.contains(name), "{name} missing:\n{m}");
    }
    promtool::assert_clean("the controller's /metrics", &m);
}
