//! Idle back-off and retry back-off (seed 004). After an empty receive a consumer's idle count grows
//! and it waits `min_idle + (2^idle - 1) x random(80..120 ms)`, capped at `max_idle`; the long-poll
//! wait already spent counts as part of that idle cycle. The `QueueEmpty` decision (how long to wait,
//! whether this consumer should stop) is a hook with this rule as its default. Failed messages come
//! back after a delay that doubles with their receive count.

use std::time::Duration;

/// The seed's back-off step (`deltaBackoffMs`); each wait draws 80-120 % of it.
pub const DELTA: Duration = Duration::from_millis(100);

/// Idle back-off parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleBackoff {
    pub min_idle: Duration,
    pub max_idle: Duration,
}

impl IdleBackoff {
    /// The wait after the `idle`-th consecutive empty receive, with `jitter` in 0.8..=1.2.
    pub fn delay_with(&self, idle: u32, jitter: f64) -> Duration {
        let factor = 2f64.powi(idle.min(62) as i32) - 1.0;
        let delta_ms = factor * DELTA.as_millis() as f64 * jitter;
        let ms = (self.min_idle.as_millis() as f64 + delta_ms).min(self.max_idle.as_millis() as f64);
        Duration::from_millis(ms as u64)
    }

    /// The wait after the `idle`-th consecutive empty receive (random jitter).
    pub fn delay(&self, idle: u32) -> Duration {
        let jitter = fleet_io::jitter::f64_in(0.8..1.2);
        self.delay_with(idle, jitter)
    }

    /// Whether `delay` has reached the cap.
    pub fn at_cap(&self, delay: Duration) -> bool {
        delay >= self.max_idle
    }
}

/// What the `QueueEmpty` hook sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmptyContext {
    /// Consecutive empty receives of this consumer.
    pub idle_count: u32,
    /// Time the empty receive itself took (its long poll): part of the idle cycle.
    pub waited: Duration,
    /// The main consumer never stops (it may park when triggers can wake it).
    pub main: bool,
    /// Consumers alive (a parked one included: it still counts towards the minimum), this one included.
    pub alive: usize,
    pub min_consumers: usize,
    /// Work-detected triggers can wake a parked consumer.
    pub triggers: bool,
}

/// The `QueueEmpty` decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmptyDecision {
    /// Wait this long (the long poll already spent counts towards it), then receive again.
    Wait(Duration),
    /// Stop this consumer.
    Stop,
    /// Make no requests until a work-detected trigger (or the safety poll) wakes the consumer.
    Park,
}

/// The default `QueueEmpty` rule: back off; once the idle cycle (the back-off, or the long poll already
/// spent when that is longer) reaches the cap, stop a surplus consumer, and park the last one when
/// triggers can wake it (zero requests while idle).
pub fn default_queue_empty(b: &IdleBackoff, ctx: EmptyContext) -> EmptyDecision {
    let delay = b.delay(ctx.idle_count);
    if !b.at_cap(delay.max(ctx.waited)) {
        return EmptyDecision::Wait(delay);
    }
    if !ctx.main && ctx.alive > ctx.min_consumers {
        EmptyDecision::Stop
    } else if ctx.main && ctx.triggers {
        EmptyDecision::Park
    } else {
        EmptyDecision::Wait(delay)
    }
}

/// Visibility back-off for failed messages: `base x 2^(receive_count - 1)`, capped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBackoff {
    pub base: Duration,
    pub max: Duration,
}

impl RetryBackoff {
    pub fn delay(&self, receive_count: u32) -> Duration {
        let shift = receive_count.saturating_sub(1).min(30);
        self.base.saturating_mul(1u32 << shift).min(self.max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: IdleBackoff = IdleBackoff { min_idle: Duration::from_millis(50), max_idle: Duration::from_secs(5) };

    #[test]
    fn delay_follows_the_formula_within_jitter_bounds() {
        for idle in 1..=5u32 {
            let steps = (1u64 << idle) - 1;
            let lo = Duration::from_millis(50 + steps * 80);
            let hi = Duration::from_millis(50 + steps * 120);
            assert_eq!(B.delay_with(idle, 0.8), lo, "idle {idle}");
            assert_eq!(B.delay_with(idle, 1.2), hi, "idle {idle}");
            for _ in 0..200 {
                let d = B.delay(idle);
                assert!(d >= lo && d <= hi, "idle {idle}: {d:?} outside {lo:?}..={hi:?}");
            }
        }
        // No idle receive yet: just the minimum.
        assert_eq!(B.delay_with(0, 1.0), Duration::from_millis(50));
    }

    #[test]
    fn delay_is_capped() {
        // 2^6 - 1 = 63 steps of >= 80 ms = 5.04 s > 5 s.
        for idle in [6, 10, 40, 1000] {
            assert_eq!(B.delay(idle), B.max_idle, "idle {idle}");
        }
        assert!(B.delay(5) < B.max_idle);
    }

    #[test]
    fn queue_empty_rule() {
        let ctx = EmptyContext { idle_count: 1, waited: Duration::ZERO, main: false, alive: 3, min_consumers: 1, triggers: true };
        assert!(matches!(default_queue_empty(&B, ctx), EmptyDecision::Wait(d) if d < B.max_idle));
        let capped = EmptyContext { idle_count: 20, ..ctx };
        assert_eq!(default_queue_empty(&B, capped), EmptyDecision::Stop);
        // Never below the minimum.
        assert_eq!(default_queue_empty(&B, EmptyContext { alive: 1, ..capped }), EmptyDecision::Wait(B.max_idle));
        // The main consumer parks only when a trigger can wake it.
        assert_eq!(default_queue_empty(&B, EmptyContext { main: true, ..capped }), EmptyDecision::Park);
        assert_eq!(default_queue_empty(&B, EmptyContext { main: true, triggers: false, ..capped }), EmptyDecision::Wait(B.max_idle));
        // A long poll that outlasted the cap is a full idle cycle: the first empty one is enough.
        let polled = EmptyContext { waited: Duration::from_secs(20), ..ctx };
        assert_eq!(default_queue_empty(&B, polled), EmptyDecision::Stop);
        assert_eq!(default_queue_empty(&B, EmptyContext { main: true, ..polled }), EmptyDecision::Park);
        assert!(matches!(default_queue_empty(&B, EmptyContext { waited: Duration::from_secs(1), ..ctx }), EmptyDecision::Wait(_)));
    }

    #[test]
    fn retry_delay_grows_with_receive_count() {
        let r = RetryBackoff { base: Duration::from_secs(2), max: Duration::from_secs(60) };
        let got: Vec<u64> = (1..=7).map(|n| r.delay(n).as_secs()).collect();
        assert_eq!(got, vec![2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(r.delay(0).as_secs(), 2);
        assert_eq!(r.delay(u32::MAX), r.max);
    }
}
