//! Expiry of buffered messages (seed 002's TTL): a message that waited in the throttle's buffer past
//! its TTL goes back to the queue, or to the dead-letter queue with reason `expired` once its job's
//! deadline has passed.

use std::sync::Arc;
use std::time::Duration;

use fleet_io::queue::{Attrs, Message, Outgoing};

use crate::consumer::fifo_group;
use crate::{bump, lock, release, ErrorEvent, Inner};

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub(crate) async fn expire(inner: Arc<Inner>, m: Message) {
    bump(&inner.stats.expired, 1);
    let past_deadline = m.attrs.deadline_ms.is_some_and(|d| now_ms() >= d);
    if let (true, Some(dlq)) = (past_deadline, &inner.dead_letter) {
        let out = Outgoing { body: m.body.clone(), attrs: Attrs { reason: Some("expired".into()), ..m.attrs.clone() } };
        match dlq.send_messages(&[out]).await {
            Ok(_) => {
                inner.handler.on_error(ErrorEvent::Expired { msg: &m, dead_lettered: true });
                lock(&inner.heartbeat).untrack(&m.receipt);
                inner.completions.delete(m.receipt);
                return;
            }
            Err(e) => {
                tracing::warn!(queue = inner.queue.name(), error = %e, "could not dead-letter an expired message; returning it")
            }
        }
    }
    inner.handler.on_error(ErrorEvent::Expired { msg: &m, dead_lettered: false });
    let group = fifo_group(&inner, &m);
    let back = lock(&inner.throttle).give_back(m, group);
    if let Some(m) = back {
        release(&inner, &m.receipt, Duration::ZERO);
    }
}
