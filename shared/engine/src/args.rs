//! Command-line flags (with environment fallbacks) for a listener, shared by processor and controller.

use std::net::SocketAddr;
use std::time::Duration;

use super::admin::AdminToken;
use super::backoff::{IdleBackoff, RetryBackoff};
use super::completion::BatchSettings;
use super::dynamic_consumers::{ScalingPolicy, WorkRules};
use super::throttle::ThrottleLimits;
use super::EngineConfig;

/// Listener settings.
#[derive(Debug, Clone, clap::Args)]
pub struct ListenerArgs {
    /// Consumers that always run (the first is the main consumer, which does the scaling).
    #[arg(long, env = "LISTENER_MIN_CONSUMERS", default_value_t = 1)]
    pub min_consumers: usize,
    /// Upper bound of consumers.
    #[arg(long, env = "LISTENER_MAX_CONSUMERS", default_value_t = 8)]
    pub max_consumers: usize,
    /// Main-consumer receive calls between two scaling checks.
    #[arg(long, env = "LISTENER_SCALE_SAMPLE_RATE", default_value_t = 2)]
    pub scale_sample_rate: u32,
    /// Receive calls without a message after which a consumer counts as idle.
    #[arg(long, env = "LISTENER_IDLE_THRESHOLD", default_value_t = 20)]
    pub idle_threshold: u32,
    /// A consumer that got a message within this many receive calls counts as busy.
    #[arg(long, env = "LISTENER_BUSY_THRESHOLD", default_value_t = 2)]
    pub busy_threshold: u32,
    /// Consumers wanted for a queue depth when work is detected: `below:count,...,*:count`.
    #[arg(long, env = "LISTENER_WORK_RULES", default_value = "10:1,40:2,100:4,*:8", value_parser = WorkRules::parse)]
    pub work_rules: WorkRules,
    /// Shortest wait after an empty receive, milliseconds.
    #[arg(long, env = "LISTENER_MIN_IDLE_MS", default_value_t = 0)]
    pub min_idle_ms: u64,
    /// Longest wait after empty receives, milliseconds (reaching it stops surplus consumers and parks
    /// the main one when triggers are on).
    #[arg(long, env = "LISTENER_MAX_IDLE_MS", default_value_t = 10_000)]
    pub max_idle_ms: u64,
    /// Long-poll wait of a receive, seconds (0-20); counts as part of the idle wait.
    #[arg(long, env = "LISTENER_RECEIVE_WAIT_SECS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=20))]
    pub receive_wait_secs: u64,
    /// Messages processed at once.
    #[arg(long, env = "LISTENER_MAX_CONCURRENCY", default_value_t = 16, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=super::throttle::MAX_CONCURRENCY as u64))]
    pub max_concurrency: usize,
    /// Priority buffer length between receiving and processing (0: receive only free capacity).
    #[arg(long, env = "LISTENER_BUFFER", default_value_t = 20, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=super::throttle::MAX_BUFFER as u64))]
    pub buffer: usize,
    /// How long a message may wait in the buffer, milliseconds (0: no limit).
    #[arg(long, env = "LISTENER_TTL_MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=super::throttle::MAX_TTL_MS))]
    pub ttl_ms: u64,
    /// Deletes and visibility changes are batched by 10 or flushed after this long, milliseconds.
    #[arg(long, env = "LISTENER_PUSH_INTERVAL_MS", default_value_t = 50)]
    pub push_interval_ms: u64,
    /// Batch calls in flight at once per queue.
    #[arg(long, env = "LISTENER_COMPLETION_CONCURRENCY", default_value_t = 4)]
    pub completion_concurrency: usize,
    /// A failed message comes back after this many seconds, doubled per receive.
    #[arg(long, env = "LISTENER_RETRY_BASE_SECS", default_value_t = 2)]
    pub retry_base_secs: u64,
    /// Longest retry back-off, seconds.
    #[arg(long, env = "LISTENER_RETRY_MAX_SECS", default_value_t = 300)]
    pub retry_max_secs: u64,
    /// Visibility is extended while a message is in hand, up to this long, seconds.
    #[arg(long, env = "LISTENER_MAX_PROCESSING_SECS", default_value_t = 900)]
    pub max_processing_secs: u64,
    /// A parked consumer polls anyway after this many seconds (0: only triggers wake it). A safety
    /// net for a fleet whose scaling agent is not running: the agent watches the work queue while the
    /// fleet is idle and announces work again that nobody takes.
    #[arg(long, env = "LISTENER_PARK_POLL_SECS", default_value_t = 3600)]
    pub park_poll_secs: u64,
    /// Serve the read-only GET /state, /metrics, /livez, /readyz and /healthz on this address (e.g.
    /// 127.0.0.1:9101).
    #[arg(long, env = "LISTENER_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Serve the admin endpoint (PUT /throttle, bearer token required) on this address; it starts only
    /// when a token is given.
    #[arg(long, env = "LISTENER_ADMIN_ADDR", default_value = "127.0.0.1:9200")]
    pub admin_addr: SocketAddr,
    /// File holding the admin endpoint's bearer token (at least 16 characters), read at start.
    #[arg(long, env = "LISTENER_ADMIN_TOKEN_FILE", value_name = "FILE", value_parser = AdminToken::from_file)]
    pub admin_token_file: Option<AdminToken>,
    /// The admin endpoint's bearer token itself (prefer the file: a flag shows in `ps`).
    #[arg(long, env = "LISTENER_ADMIN_TOKEN", hide_env_values = true, value_name = "TOKEN", value_parser = AdminToken::parse, conflicts_with = "admin_token_file")]
    pub admin_token: Option<AdminToken>,
}

impl Default for ListenerArgs {
    /// The flags' defaults (environment fallbacks apply, as for the binaries).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            args: ListenerArgs,
        }
        <Only as clap::Parser>::parse_from(["listener"]).args
    }
}

impl ListenerArgs {
    /// The admin endpoint's token, from the file or the environment.
    pub fn admin_token(&self) -> Option<AdminToken> {
        self.admin_token_file.clone().or_else(|| self.admin_token.clone())
    }

    /// Short waits for tests and demos: 1 s long polls, idle back-off capped at 1 s, immediate retries,
    /// up to 3 consumers.
    pub fn quick() -> ListenerArgs {
        ListenerArgs { receive_wait_secs: 1, max_idle_ms: 1000, retry_base_secs: 0, max_consumers: 3, ..ListenerArgs::default() }
    }

    /// The engine configuration; `triggers`: work-detected triggers can wake parked consumers.
    pub fn engine(&self, triggers: bool) -> EngineConfig {
        EngineConfig {
            scaling: ScalingPolicy {
                min_consumers: self.min_consumers,
                max_consumers: self.max_consumers,
                sample_rate: self.scale_sample_rate,
                idle_threshold: self.idle_threshold,
                busy_threshold: self.busy_threshold,
            },
            backoff: IdleBackoff { min_idle: Duration::from_millis(self.min_idle_ms), max_idle: Duration::from_millis(self.max_idle_ms) },
            receive_wait: Duration::from_secs(self.receive_wait_secs.min(20)),
            receive_batch: 10,
            work_rules: self.work_rules.clone(),
            throttle: ThrottleLimits {
                max_concurrency: self.max_concurrency,
                buffer: self.buffer,
                ttl: (self.ttl_ms > 0).then(|| Duration::from_millis(self.ttl_ms)),
            },
            completion: BatchSettings {
                batch_size: 10,
                push_interval: Duration::from_millis(self.push_interval_ms),
                max_concurrency: self.completion_concurrency,
                max_attempts: 5,
            },
            retry: RetryBackoff { base: Duration::from_secs(self.retry_base_secs), max: Duration::from_secs(self.retry_max_secs) },
            heartbeat: true,
            max_processing: Duration::from_secs(self.max_processing_secs),
            triggers,
            park_poll: (self.park_poll_secs > 0).then(|| Duration::from_secs(self.park_poll_secs)),
        }
    }
}
