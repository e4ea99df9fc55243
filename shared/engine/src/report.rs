//! Instance reports (the scaling agent's per-instance signals): while an engine holds work, it publishes
//! what it completed, its rate, the work in hand and whether it was saturated, every interval, on the
//! fleet bus; a parked (idle) engine publishes nothing, so an idle fleet still makes no requests. A last
//! report says the instance is leaving.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Engine;
use crate::state::Counts;
use fleet_io::trigger::{InstanceReport, TriggerBus};

/// A stable id for this process: the host name (a container's id under Docker, the pod's name under
/// Kubernetes) and the process id.
pub fn instance_id() -> String {
    let host = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()).or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_string()));
    format!("{}-{}", host.unwrap_or_else(|| "host".into()), std::process::id())
}

/// The counts of an instance's engines (one per shard of the work queue) together.
fn counts(engines: &[Engine]) -> Counts {
    engines.iter().map(Engine::counts).fold(Counts::default(), |a, c| Counts {
        in_hand: a.in_hand + c.in_hand,
        processed: a.processed + c.processed,
        consumers_active: a.consumers_active + c.consumers_active,
        concurrency_limit: a.concurrency_limit + c.concurrency_limit,
    })
}

/// What one report says, from the engines' counts `c` and the processed count `last` of `dt` before.
fn report(engines: &[Engine], instance: &str, c: &Counts, last: u64, dt: Duration, leaving: bool) -> InstanceReport {
    let processed = c.processed;
    let mut paused_for: Vec<String> = engines.iter().flat_map(Engine::paused_for).collect();
    paused_for.sort();
    paused_for.dedup();
    InstanceReport {
        instance: instance.to_string(),
        // Shard 0's name is the work queue's: the agent knows the instance by it.
        queue: engines[0].queue_name().to_string(),
        processed,
        rate: if dt.is_zero() { 0.0 } else { processed.saturating_sub(last) as f64 / dt.as_secs_f64() },
        in_hand: c.in_hand as u64,
        consumers: c.consumers_active as u32,
        saturated: c.in_hand >= c.concurrency_limit,
        leaving,
        paused_for,
    }
}

/// Publishes the instance's reports every `interval` while its engines (one per shard of the work
/// queue; at least one) have work in hand or completed some since the last report, until `stop`; then
/// one `leaving` report. Failures are logged at debug level (a report is a hint; the next one replaces
/// it).
pub fn spawn_reporter(
    engines: Vec<Engine>,
    bus: Arc<dyn TriggerBus>,
    instance: String,
    interval: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    assert!(!engines.is_empty(), "an instance report needs an engine");
    tokio::spawn(async move {
        let mut last = counts(&engines).processed;
        let mut last_at = Instant::now();
        let mut reported_any = false;
        loop {
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
            let c = counts(&engines);
            if c.in_hand == 0 && c.processed == last {
                last_at = Instant::now();
                continue;
            }
            let r = report(&engines, &instance, &c, last, last_at.elapsed(), false);
            (last, last_at, reported_any) = (c.processed, Instant::now(), true);
            publish(bus.as_ref(), &r).await;
        }
        if reported_any {
            let c = counts(&engines);
            let r = report(&engines, &instance, &c, last, last_at.elapsed(), true);
            publish(bus.as_ref(), &r).await;
        }
    })
}

async fn publish(bus: &dyn TriggerBus, r: &InstanceReport) {
    match tokio::time::timeout(Duration::from_secs(5), bus.report(r)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "could not publish an instance report"),
        Err(_) => tracing::debug!("publishing an instance report timed out"),
    }
}
