//! The engine's settings (built from the command line by `args`) and their defaults, and the fixed
//! receive bounds they do not set.

use std::time::Duration;

use crate::backoff::{IdleBackoff, RetryBackoff};
use crate::completion::BatchSettings;
use crate::dynamic_consumers::{ScalingPolicy, WorkRules};
use crate::throttle::ThrottleLimits;

/// How long a receive may take beyond its long-poll wait before it is abandoned (consumers; the
/// health check's stall bound counts it too).
pub(crate) const RECEIVE_GRACE: Duration = Duration::from_secs(10);
/// How long past its long-poll wait a receive in flight at a stop is waited for.
pub(crate) const STOP_POLL_MARGIN: Duration = Duration::from_secs(1);

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub scaling: ScalingPolicy,
    pub backoff: IdleBackoff,
    /// Long-poll wait of a receive (at most 20 s); it counts as part of the idle cycle.
    pub receive_wait: Duration,
    /// Messages per receive (1-10).
    pub receive_batch: usize,
    /// Consumers wanted for a queue depth when work is detected.
    pub work_rules: WorkRules,
    pub throttle: ThrottleLimits,
    /// Delete and visibility-change batching.
    pub completion: BatchSettings,
    pub retry: RetryBackoff,
    /// Extend visibility at half the timeout while a message is in hand.
    pub heartbeat: bool,
    /// Stop extending a message after this long.
    pub max_processing: Duration,
    /// Work-detected triggers can wake a parked consumer.
    pub triggers: bool,
    /// A parked consumer polls anyway after this long (a lost trigger costs at most this delay).
    pub park_poll: Option<Duration>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            scaling: ScalingPolicy::DEFAULT,
            backoff: IdleBackoff { min_idle: Duration::ZERO, max_idle: Duration::from_secs(10) },
            receive_wait: Duration::from_secs(20),
            receive_batch: 10,
            work_rules: WorkRules::default(),
            throttle: ThrottleLimits { max_concurrency: 16, buffer: 20, ttl: None },
            completion: BatchSettings::default(),
            retry: RetryBackoff { base: Duration::from_secs(2), max: Duration::from_secs(300) },
            heartbeat: true,
            max_processing: Duration::from_secs(15 * 60),
            triggers: false,
            park_poll: Some(Duration::from_secs(3600)),
        }
    }
}
