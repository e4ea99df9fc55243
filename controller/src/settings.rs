//! The controller's settings: every flag with its environment variable and default (the README's
//! table lists them; `deploy/e2e/tests/it/readme_config.rs` checks it against these), and the timings the
//! start check reads from them (`timings`).

use std::net::SocketAddr;
use std::time::Duration;

use fleet_domain::prices::Prices;
use fleet_engine::admin::AdminToken;
use fleet_engine::args::ListenerArgs;

use crate::{aggregate, timings};

/// Controller settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Settings {
    #[command(flatten)]
    pub listener: ListenerArgs,
    /// The whole stop, seconds from the signal: the batch in hand, the last checkpoint, the leases
    /// given back and purges under way, under this one deadline (keep it below the pod's
    /// terminationGracePeriodSeconds, 45 in deploy/k8s).
    #[arg(long, env = "CONTROLLER_DRAIN_SECS", default_value_t = 30)]
    pub drain_secs: u64,
    /// A job that has not sealed (its initiator stopped mid-submission) is finished as `abandoned`,
    /// with what was processed, after this many seconds without a result (longer than a parked
    /// listener's safety poll, `--park-poll-secs`, so that a seal sent without a trigger is read first).
    #[arg(long, env = "CONTROLLER_ABANDON_AFTER", default_value_t = DEFAULT_ABANDON_AFTER, value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub abandon_after: u64,
    /// A sealed job that gets no news for this many seconds, once every message that was in the
    /// fleet's queues (work, results, their dead-letter queues) at its last news has left them (each
    /// queue seen empty in turn, in the order messages move), is finished as `partial`, its missing
    /// chunks named as failed: their work items were lost (queue retention, FIFO de-duplication) and
    /// can no longer arrive. Needs the work queue (`Deps::work`).
    #[arg(long, env = "CONTROLLER_STALL_AFTER", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=30 * 86_400))]
    pub stall_after: u64,
    /// A job whose chunks are all in but some failed (a failure report, a dead letter, an unreadable
    /// result) is finished this many seconds after its last news, so that a real result still on its
    /// way replaces a failure; keep it above the work queue's visibility timeout plus an S3 call
    /// deadline or two (the longest a controller losing S3 sits on a result before a peer gets it).
    #[arg(long, env = "CONTROLLER_SETTLE_SECS", default_value_t = aggregate::SETTLE.as_secs(), value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub settle_secs: u64,
    /// Lease time, seconds: of each job (one owner at a time) and of each controller's membership in
    /// the results partitions' ownership: a dead controller's partitions and jobs are taken over this
    /// long after its last renewal (renewed every third of it).
    #[arg(long, env = "CONTROLLER_LEASE_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(3..=3600))]
    pub lease_secs: u64,
    /// Name of this controller in job leases; unique per controller, stable across its restarts
    /// [default: $HOSTNAME, else controller-PID].
    #[arg(long, env = "CONTROLLER_ID")]
    pub id: Option<String>,
    /// A finished job's chunk and result blobs (its transactions) are deleted this many seconds after
    /// its report is written (0: at once); the report, accounts, manifest and checkpoint stay.
    #[arg(long, env = "CONTROLLER_BLOB_RETENTION_SECS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=365 * 86_400))]
    pub blob_retention_secs: u64,
    /// The keyring (a directory of `*.key` files, one key each: `ROLE BASE64`): every role's key,
    /// several of a role while one is rotated. With it, a message counts only when it is signed by a
    /// role that may send it (results by processors, seals by submitters, abandons by submitters or
    /// operators, forwarded dead letters by controllers, dead-lettered work items by submitters);
    /// anything else is quarantined. This controller signs what it forwards with the keyring's
    /// controller key. Without it, messages are not checked by role (a warning says so at start).
    /// See docs/security.md.
    #[arg(long = "role-keys", env = "FLEET_ROLE_KEYS", value_name = "DIR", value_parser = role_keys)]
    pub role_keys: Option<fleet_io::auth::Keyring>,
    /// Serve the status page (GET / and /status.json; with the page token, GET /jobs/{id} and
    /// /jobs/{id}/report) on this address (e.g. 127.0.0.1:9300), apart from the metrics and health on
    /// `--http-addr`, so that a monitoring system let in to scrape metrics reaches no billing data.
    #[arg(long, env = "CONTROLLER_PAGE_ADDR")]
    pub page_addr: Option<SocketAddr>,
    /// File holding the status page's bearer token (at least 16 characters), read at start: job
    /// reports (every account's totals) and per-job detail are served only to requests carrying it,
    /// and not at all without one.
    #[arg(long, env = "CONTROLLER_PAGE_TOKEN_FILE", value_name = "FILE", value_parser = AdminToken::from_file)]
    pub page_token_file: Option<AdminToken>,
    /// The status page's bearer token itself (prefer the file: a flag shows in `ps`).
    #[arg(long, env = "CONTROLLER_PAGE_TOKEN", hide_env_values = true, value_name = "TOKEN", value_parser = AdminToken::parse, conflicts_with = "page_token_file")]
    pub page_token: Option<AdminToken>,
    /// The scaling agent's state endpoint (e.g. http://scaling-agent:9090), read by the status page
    /// (`GET /` on `--page-addr`) for the fleet, its decisions and the queues' depths; without it
    /// the page reads the depths from SQS and shows no fleet.
    #[arg(long, env = "CONTROLLER_AGENT_URL")]
    pub agent_url: Option<String>,
    /// Memory budget of decoded results, MiB: the result payloads decompressed and decoded at once,
    /// across all jobs and batches, each counted for the most its chunk's records allow, stay within
    /// it whatever arrives (keep it well below the container's memory limit; a result larger than the
    /// whole budget is decoded alone).
    #[arg(long, env = "CONTROLLER_DECODE_BUDGET_MIB", default_value_t = aggregate::budget::DEFAULT_BUDGET_MIB, value_parser = clap::value_parser!(u64).range(16..=1 << 20))]
    pub decode_budget_mib: u64,
    /// The price table each report's request cost is computed with, USD: `key=value` pairs overriding
    /// AWS's us-east-1 list prices (`sqs` per million requests, `s3_put` and `s3_get` per thousand).
    #[arg(long, env = "FLEET_PRICES", default_value = "sqs=0.40,s3_put=0.005,s3_get=0.0004")]
    pub prices: Prices,
    /// Start even when the timings fail the start check (`controller::timings`: a settle time shorter
    /// than a held result can be away, an abandon time shorter than a parked listener's poll): for test
    /// rigs and demos with short waits; the failures are logged as warnings.
    #[arg(long, env = "CONTROLLER_UNCHECKED_TIMINGS", value_parser = clap::builder::FalseyValueParser::new())]
    pub unchecked_timings: bool,
}

/// Default `--abandon-after`, seconds: two hours, above a parked listener's hourly safety poll.
pub const DEFAULT_ABANDON_AFTER: u64 = controller_core::timings::ABANDON_AFTER.as_secs();

impl Settings {
    /// The timings the start check reads: these settings', the fleet's call deadline and the work
    /// queue's visibility timeout (when read).
    pub fn timings(&self, call_deadline: Duration, work_visibility: Option<Duration>, results_visibility: Option<Duration>) -> timings::Timings {
        timings::Timings {
            settle: Duration::from_secs(self.settle_secs),
            lease: Duration::from_secs(self.lease_secs),
            abandon_after: Duration::from_secs(self.abandon_after),
            park_poll: (self.listener.park_poll_secs > 0).then(|| Duration::from_secs(self.listener.park_poll_secs)),
            receive_wait: Duration::from_secs(self.listener.receive_wait_secs),
            call_deadline,
            work_visibility,
            results_visibility,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            listener: ListenerArgs::default(),
            drain_secs: 30,
            abandon_after: DEFAULT_ABANDON_AFTER,
            stall_after: 3600,
            settle_secs: aggregate::SETTLE.as_secs(),
            lease_secs: 30,
            id: None,
            blob_retention_secs: 0,
            agent_url: None,
            page_addr: None,
            page_token_file: None,
            page_token: None,
            decode_budget_mib: aggregate::budget::DEFAULT_BUDGET_MIB,
            prices: Prices::default(),
            unchecked_timings: false,
            role_keys: None,
        }
    }
}

/// Reads the keyring directory given by `--role-keys` (an error names the file and line).
fn role_keys(dir: &str) -> Result<fleet_io::auth::Keyring, String> {
    fleet_io::auth::Keyring::from_dir(std::path::Path::new(dir)).map_err(|e| e.to_string())
}
