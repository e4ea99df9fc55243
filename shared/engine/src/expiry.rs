//! Expiry of buffered messages (seed 002's TTL): a message that waited in the throttle's buffer past
//! its TTL goes back to the queue, or to the dead-letter queue with reason `expired` once its job's
//! deadline has passed.

use std::sync::Arc;
use std::time::Duration;

use fleet_io::queue::{Delivery, Message};

use crate::consumer::fifo_group;
use crate::events;
use crate::{lock, release, ErrorEvent, Inner};

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub(crate) async fn expire(inner: Arc<Inner>, m: Delivery) {
    events::Expired { queue: inner.queue.name(), message_id: &m.id }.emit(&inner.observed.stats);
    let past_deadline = m.attrs.deadline_ms.is_some_and(|d| now_ms() >= d);
    let m = match (past_deadline, &inner.dead_letter) {
        (true, Some(dlq)) => {
            let (message, receipt): (Message, String) = ((*m).clone(), m.receipt().to_string());
            match m.dead_letter(inner.queue.as_ref(), dlq.as_ref(), "expired").await {
                Ok(()) => {
                    inner.in_hand.untrack(&receipt);
                    inner.handler.on_error(ErrorEvent::Expired { msg: &message, dead_lettered: true });
                    return;
                }
                Err((e, m)) => {
                    events::DeadLetterFailed { queue: inner.queue.name(), why: "expired", error: &e }.emit();
                    m
                }
            }
        }
        _ => m,
    };
    inner.handler.on_error(ErrorEvent::Expired { msg: &m, dead_lettered: false });
    let group = fifo_group(&inner, &m);
    let back = lock(&inner.buffer.throttle).give_back(m, group);
    if let Some(m) = back {
        release(&inner, m, Duration::ZERO);
    }
}
