//! The readers of the results partitions this controller owns, and the balancing round that starts
//! and stops them: `Ownership` (`super`) says which partitions are this controller's; [`rebalance`]
//! acts on what a round says (stops first, all at once, then starts), and [`Readers`] runs a
//! listener on each owned partition's results queue and one on its dead-letter queue.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fleet_engine::http::Engines;
use fleet_engine::{Engine, EngineConfig};
use fleet_io::queue::Queue;
use fleet_io::trigger::Subscription;
use tokio_util::sync::CancellationToken;

use super::Ownership;
use crate::aggregate::{self, Aggregator, Source};
use crate::handler::{complete, Notifiers, ResultsHandler};
use crate::{events, undo};

/// The results partitions this controller reads: for each, a listener on its results queue and one on
/// its dead-letter queue, started when the partition is gained and stopped (the batch in hand
/// applied, its jobs checkpointed and their leases given back) when it is given up.
pub(crate) struct Readers {
    /// Every partition's results queue and dead-letter queue, by number.
    pub(crate) parts: Vec<(Arc<dyn Queue>, Arc<dyn Queue>)>,
    pub(crate) running: BTreeMap<u16, (Vec<Engine>, CancellationToken)>,
    pub(crate) cfg: EngineConfig,
    pub(crate) dlq_cfg: EngineConfig,
    pub(crate) agg: Arc<Aggregator>,
    pub(crate) notifiers: Arc<Notifiers>,
    pub(crate) store_breaker: Option<Arc<fleet_io::breaker::Breaker>>,
    pub(crate) triggers: Option<Subscription>,
    /// What the state endpoint answers for.
    pub(crate) engines: Engines,
    pub(crate) shutdown: CancellationToken,
    /// This controller's name (in its partition events).
    pub(crate) owner: String,
}

impl Readers {
    pub(crate) fn running(&self) -> BTreeSet<u16> {
        self.running.keys().copied().collect()
    }

    pub(crate) async fn start(&mut self, p: u16) -> fleet_io::Result<()> {
        let Some((results, dlq)) = self.parts.get(usize::from(p)).cloned() else { return Ok(()) };
        let token = self.shutdown.child_token();
        self.agg.reading().read(p);
        // In `running` from the first listener on, so that a start cut short (an error, the stop) is
        // stopped like any other.
        self.running.insert(p, (Vec::with_capacity(2), token.clone()));
        // Gained as its first listener may receive (a start cut short gives it up again).
        events::PartitionChanged { owner: &self.owner, partition: p, owned: true }.emit();
        for (source, q, cfg) in [(Source::Results, results, self.cfg.clone()), (Source::ResultsDeadLetter, dlq, self.dlq_cfg.clone())] {
            let handler = Arc::new(ResultsHandler {
                source,
                queue: q.name().to_string(),
                agg: self.agg.clone(),
                notifiers: self.notifiers.clone(),
                store_breaker: self.store_breaker.clone(),
            });
            let e = match Engine::start(q, None, handler, cfg).await {
                Ok(e) => e,
                Err(err) => {
                    self.stop(p, Duration::ZERO).await;
                    return Err(err);
                }
            };
            if let Some(sub) = &self.triggers {
                e.follow_triggers(sub, token.clone());
            }
            self.engines.add(e.clone());
            if let Some((engines, _)) = self.running.get_mut(&p) {
                engines.push(e);
            }
        }
        let engines = self.running.get(&p).map(|(e, _)| e.clone()).unwrap_or_default();
        // Its quiet jobs, known to its last reader only, are found by the next expiry tick.
        if !undo::is(undo::Fix::RescanOnGain) {
            self.agg.rescan_soon();
        }
        if undo::is(undo::Fix::HeirWakes) {
            return Ok(());
        }
        // Messages the partition's last reader held when it died are invisible for a while yet (its
        // receives for a visibility timeout, its hold for longer) and nobody announces them when they
        // are visible again: the new listeners look then, instead of parking until their safety poll.
        let wakes = engines;
        let stop = token;
        let results = self.parts[usize::from(p)].0.clone();
        tokio::spawn(async move {
            let visibility = results.info().await.map(|i| i.visibility_timeout).unwrap_or(Duration::from_secs(30));
            let mut at = vec![visibility, visibility * 2, aggregate::hold::HOLD_VISIBILITY];
            at.sort();
            let started = tokio::time::Instant::now();
            for after in at {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep_until(started + after + Duration::from_secs(1)) => {}
                }
                for e in &wakes {
                    e.wake(None).await;
                }
            }
        });
        Ok(())
    }

    /// Stops reading partition `p`: its listeners quiesce (within `grace`), the jobs of the partition
    /// are checkpointed and their messages deleted, their leases given back, what was held for them
    /// handed back, the listeners finish. It leaves `running` last (a stop cut short is done again).
    pub(crate) async fn stop(&mut self, p: u16, grace: Duration) {
        let Some((engines, token)) = self.running.get(&p).cloned() else { return };
        futures::future::join_all(engines.iter().map(|e| e.quiesce(grace))).await;
        // Held first: letting go checkpoints the partition's jobs, which may wait out a hung store.
        hand_back_held(&self.agg, Some(p));
        complete(self.agg.let_go(p).await);
        hand_back_held(&self.agg, Some(p));
        for e in &engines {
            e.finish(true).await;
            self.engines.remove(e.queue_name());
        }
        token.cancel();
        self.running.remove(&p);
        events::PartitionChanged { owner: &self.owner, partition: p, owned: false }.emit();
    }

    /// Stops reading every partition, all listeners quiescing at once.
    pub(crate) async fn stop_all(&mut self, grace: Duration) {
        self.stop_some(&self.running(), grace).await;
    }

    /// Stops reading the partitions of `which`, all their listeners quiescing at once.
    pub(crate) async fn stop_some(&mut self, which: &BTreeSet<u16>, grace: Duration) {
        let engines: Vec<Engine> = self.running.iter().filter(|(p, _)| which.contains(p)).flat_map(|(_, (e, _))| e.clone()).collect();
        futures::future::join_all(engines.iter().map(|e| e.quiesce(grace))).await;
        for p in which {
            self.stop(*p, Duration::ZERO).await;
        }
    }
}

/// One balancing round (see `super`): partitions asked for are stopped and handed over, free ones
/// claimed and started; a controller that could not renew its membership in time stops reading first.
pub(crate) async fn rebalance(own: &tokio::sync::Mutex<Ownership>, readers: &tokio::sync::Mutex<Readers>, leaving: bool) {
    let mut own = own.lock().await;
    let mut readers = readers.lock().await;
    // A partition is given up within half a lease (what its listeners still hold comes back after
    // its visibility timeout), so that the membership renewed before it stays valid meanwhile.
    let grace = own.ttl() / 2;
    if !own.fresh() && !readers.running.is_empty() && !undo::is(undo::Fix::StaleStopsReading) {
        stop_stale(&mut readers, grace).await;
    }
    // The partitions a round says to stop are stopped at once, their listeners quiescing together
    // (one taken while this controller could not renew is read by its new owner already: one per
    // round, each waiting out its grace, kept a paused controller reading three partitions it had
    // lost for a minute); then the round is planned again, renewing the membership first.
    for _ in 0..readers.parts.len() + 3 {
        let running = readers.running();
        let stale_at = own.stale_at();
        let round = own.round(&running, leaving);
        tokio::pin!(round);
        let mut stopped = running.is_empty() || stale_at.is_none() || undo::is(undo::Fix::StaleStopsReading);
        let result = loop {
            tokio::select! {
                biased;
                // The membership goes stale while the round hangs (a read, then a write, each up to
                // the store's call deadline): reading stops then,
                // not when the round gives up (a round that hung kept a controller reading on for
                // 67 s in the simulation, seed 369).
                _ = tokio::time::sleep_until(stale_at.unwrap_or_else(tokio::time::Instant::now)), if !stopped => {
                    stopped = true;
                    stop_stale(&mut readers, grace).await;
                }
                r = &mut round => break r,
            }
        };
        match result {
            Ok(plan) if !plan.stop.is_empty() => {
                events::PartitionsToStop { owner: &readers.owner, partitions: &plan.stop, stale: false }.emit();
                if undo::is(undo::Fix::StopAtOnce) {
                    if let Some(p) = plan.stop.first() {
                        readers.stop(*p, grace).await;
                    }
                } else {
                    readers.stop_some(&plan.stop, grace).await;
                }
            }
            Ok(plan) => {
                for p in plan.start {
                    if let Err(e) = readers.start(p).await {
                        tracing::warn!(partition = p, error = %e, "could not start reading a partition; tried again next round");
                    }
                }
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "partition balancing round failed; tried again next round");
                return;
            }
        }
    }
}

/// The membership was not renewed in time: every partition stops (within `grace`) until it is.
async fn stop_stale(readers: &mut Readers, grace: Duration) {
    tracing::warn!(partitions = ?readers.running(), "partition ownership not renewed in time: reading none until it is");
    events::PartitionsToStop { owner: &readers.owner, partitions: &readers.running(), stale: true }.emit();
    readers.stop_all(grace).await;
}

/// Hands what is held through a store outage for partition `p` (`None`: all) back to its queue, visible
/// at once.
pub(crate) fn hand_back_held(agg: &Aggregator, p: Option<u16>) {
    for k in agg.holding().hand_back(p) {
        k.release(Duration::ZERO);
    }
}
