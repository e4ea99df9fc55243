//! Work-detected triggers (seed 004): an engine follows its queue's triggers on the bus, waking parked
//! consumers and raising the consumer count at once, and follows the subscription's liveness, so that
//! consumers park only while a trigger can reach them. When the bus comes back, consumers keep polling
//! for [`REJOIN_GRACE`] before they park again: publishers that failed while it was down wait out
//! their reconnect back-off (up to 30 s) before they publish again, and a trigger skipped meanwhile
//! would leave a parked listener asleep until its safety poll.

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use fleet_io::trigger::Subscription;

use crate::Engine;

/// How long after the bus comes back consumers still poll before they park again: the longest
/// reconnect back-off of a publisher (`fleet_io::trigger::rabbitmq`).
pub const REJOIN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

impl Engine {
    /// Wakes the engine on every work-detected trigger for its queue until `stop`, and follows the
    /// subscription's liveness: while the bus is down no consumer parks (a parked one is woken to poll at
    /// its back-off cap), and when it comes back the engine polls at once (a trigger published meanwhile
    /// was lost) and may park again [`REJOIN_GRACE`] later.
    pub fn follow_triggers(&self, sub: &Subscription, stop: CancellationToken) {
        let engine = self.clone();
        let mut rx = sub.events.subscribe();
        let mut live = sub.live.clone();
        self.inner.lifecycle.service_tasks.spawn(async move {
            let inner = &engine.inner;
            let mut was_live = *live.borrow_and_update();
            inner.wakeups.set_triggers_live(was_live);
            if !was_live {
                inner.wakeups.rouse();
            }
            // When the bus came back: parking is allowed again at this time. (Not after the first
            // connection: nobody has been failing to publish.)
            let mut park_at: Option<tokio::time::Instant> = None;
            let mut ever_live = was_live;
            loop {
                let grace = async {
                    match park_at {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = inner.lifecycle.stop_receiving.cancelled() => return,
                    _ = grace => {
                        park_at = None;
                        inner.wakeups.set_triggers_live(true);
                        tracing::debug!(queue = engine.queue_name(), "publishers had time to reconnect: idle consumers park again");
                    }
                    changed = live.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let now_live = *live.borrow_and_update();
                        if !now_live {
                            park_at = None;
                            inner.wakeups.set_triggers_live(false);
                        } else if !was_live && ever_live {
                            park_at = Some(tokio::time::Instant::now() + REJOIN_GRACE);
                        } else if !was_live {
                            inner.wakeups.set_triggers_live(true);
                        }
                        ever_live |= now_live;
                        if now_live != was_live {
                            tracing::info!(queue = engine.queue_name(), live = now_live, "work-detected triggers {}", if now_live { "reach this listener again" } else { "unreachable: polling instead of parking" });
                            // Down: parked consumers go back to polling. Back: one poll for what a
                            // lost trigger announced.
                            inner.wakeups.wake();
                        }
                        was_live = now_live;
                    }
                    ev = rx.recv() => match ev {
                        Ok(ev) if engine.answers_to(&ev.queue) => {
                            tracing::debug!(source = %ev.source, messages = ev.messages, "work-detected trigger");
                            engine.wake((ev.messages > 0).then_some(ev.messages)).await;
                        }
                        // Triggers were dropped unread (a burst outran this task): one of them may
                        // have been for this queue, so its parked consumers poll now rather than at
                        // their safety poll.
                        Err(broadcast::error::RecvError::Lagged(missed)) => {
                            tracing::debug!(queue = engine.queue_name(), missed, "triggers missed; waking to poll");
                            engine.wake(None).await;
                        }
                        Ok(_) => {}
                        Err(broadcast::error::RecvError::Closed) => return,
                    }
                }
            }
        });
    }

    /// Whether a trigger can reach this engine now (see [`Engine::follow_triggers`]).
    pub fn triggers_live(&self) -> bool {
        self.inner.cfg.triggers && self.inner.wakeups.triggers_live()
    }
}
