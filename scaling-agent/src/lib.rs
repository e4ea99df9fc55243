//! The scaling agent (minimal for now): watches the fleet's queues and reports their depth and
//! in-flight counts, and publishes a work-detected trigger when a queue turns non-empty (the work queue
//! for processors; the results queue and the work dead-letter queue for the controller, covering what
//! nobody announced, such as a dead letter moved by SQS redrive), so parked listeners wake without
//! waiting for their next poll. Scaling processor instances comes later.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use shared::queue::{Queue, QueueDepth};
use shared::trigger::{announce, TriggerBus, WorkDetected};
use tokio_util::sync::CancellationToken;

/// Agent settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    /// Seconds between two looks at the queues.
    #[arg(long, env = "AGENT_INTERVAL_SECS", default_value_t = 5)]
    pub interval_secs: u64,
}

/// The queues watched, by role.
pub struct Watched {
    pub work: Arc<dyn Queue>,
    pub work_dlq: Arc<dyn Queue>,
    pub results: Arc<dyn Queue>,
}

/// Depths of all watched queues.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub work: QueueDepth,
    pub work_dlq: QueueDepth,
    pub results: QueueDepth,
}

pub async fn snapshot(w: &Watched) -> shared::Result<Snapshot> {
    Ok(Snapshot { work: w.work.depth().await?, work_dlq: w.work_dlq.depth().await?, results: w.results.depth().await? })
}

/// Looks at the queues every interval until `shutdown`; logs depths and triggers on empty -> non-empty.
pub async fn run(settings: Settings, watched: Watched, triggers: Option<Arc<dyn TriggerBus>>, shutdown: CancellationToken) -> shared::Result<()> {
    let mut was_empty = [true; 3];
    loop {
        match snapshot(&watched).await {
            Ok(s) => {
                tracing::info!(
                    work_visible = s.work.visible,
                    work_in_flight = s.work.in_flight,
                    work_dlq = s.work_dlq.visible,
                    results_visible = s.results.visible,
                    results_in_flight = s.results.in_flight,
                    "queue depths"
                );
                let seen = [(&watched.work, s.work.visible), (&watched.results, s.results.visible), (&watched.work_dlq, s.work_dlq.visible)];
                for ((queue, visible), was_empty) in seen.into_iter().zip(was_empty.iter_mut()) {
                    if *was_empty && visible > 0 {
                        if let Some(t) = &triggers {
                            announce(t.as_ref(), &WorkDetected { queue: queue.name().to_string(), messages: visible, source: "scaling-agent".into() }).await;
                        }
                    }
                    *was_empty = visible == 0;
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not read queue depths"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(settings.interval_secs.max(1))) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shared::memory::MemoryQueue;
    use shared::trigger::MemoryTriggers;

    #[tokio::test(start_paused = true)]
    async fn triggers_once_when_work_appears() {
        let work = MemoryQueue::new("billing-work", Duration::from_secs(30));
        let dlq = MemoryQueue::new("dlq", Duration::from_secs(30));
        let watched = Watched { work: work.clone(), work_dlq: dlq.clone(), results: MemoryQueue::new("r", Duration::from_secs(30)) };
        let bus = MemoryTriggers::new();
        let mut rx = bus.tx.subscribe();
        let stop = CancellationToken::new();
        let agent = tokio::spawn(run(Settings { interval_secs: 1 }, watched, Some(bus.clone() as Arc<dyn TriggerBus>), stop.clone()));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(rx.try_recv().is_err(), "no trigger while the queue is empty");
        work.send(vec!["a".to_string(), "b".to_string()]).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ev = rx.try_recv().expect("a trigger when work appears");
        assert_eq!((ev.queue.as_str(), ev.messages, ev.source.as_str()), ("billing-work", 2, "scaling-agent"));
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(rx.try_recv().is_err(), "one trigger per empty -> non-empty transition");
        // A dead letter nobody announced wakes the controller's dead-letter listener.
        dlq.send(vec!["d".to_string()]).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ev = rx.try_recv().expect("a trigger for the dead-letter queue");
        assert_eq!((ev.queue.as_str(), ev.messages), ("dlq", 1));
        assert!(rx.try_recv().is_err());
        stop.cancel();
        agent.await.unwrap().unwrap();
    }
}
