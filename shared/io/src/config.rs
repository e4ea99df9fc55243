//! Why one file: every binary reads the fleet's names and builds its clients here, so that the four
//! agree on a queue's or bucket's name and on how the AWS environment is read.
//!
//! Configuration shared by every binary: resource names (clap flags with env fallbacks) and the AWS
//! clients, built from the standard AWS environment (AWS_ENDPOINT_URL, AWS_REGION, profiles).

use std::sync::Arc;
use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, SdkConfig};

use crate::auth::Key;
use crate::blob::S3Store;
use crate::breaker::Breakers;
use crate::call::{CallArgs, CallCounter, CallPolicy};
use crate::error::{Error, Result};
use crate::queue::{Queue, Sharded, SqsQueue};
use crate::trigger::{redact_url, spawn_subscription, AmqpCa, RabbitTriggers, Subscription, TriggerBus};

/// A bucket name as S3 takes it (3 to 63 lowercase letters, digits, dots and hyphens, beginning and
/// ending with a letter or digit): a bad one is said at once, by name, not as the SDK's error.
pub fn bucket_name(s: &str) -> Result<String, String> {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-';
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !(3..=63).contains(&s.len()) {
        return Err(format!("bucket name {s:?}: must have 3 to 63 characters, has {}", s.len()));
    }
    if let Some(c) = s.chars().find(|c| !ok_char(*c)) {
        return Err(format!("bucket name {s:?}: {c:?} is not allowed (lowercase letters, digits, '.' and '-' only)"));
    }
    if !edge(s.chars().next()) || !edge(s.chars().last()) {
        return Err(format!("bucket name {s:?}: must begin and end with a lowercase letter or a digit"));
    }
    Ok(s.to_string())
}

/// `--signing-key`: the key file read and checked at once; an error names the file (never the secret).
fn signing_key_file(path: &str) -> Result<Key, String> {
    Key::from_file(std::path::Path::new(path)).map_err(|e| match e {
        Error::Config(why) => format!("signing key {why}"),
        e => format!("signing key {path}: {e}"),
    })
}

/// Names of the fleet's queues, bucket and trigger exchange.
#[derive(Clone, clap::Args)]
pub struct FleetArgs {
    /// S3 bucket for chunk blobs (jobs/ prefix) and reports (warehouse/ prefix).
    #[arg(long, global = true, env = "FLEET_BUCKET", default_value = "billing-fleet", value_parser = bucket_name)]
    pub bucket: String,
    /// Work queue (name or URL).
    #[arg(long, global = true, env = "FLEET_WORK_QUEUE", default_value = "billing-work")]
    pub work_queue: String,
    /// Dead-letter queue of the work queue (name or URL) [default: the work queue's name with `-dlq`,
    /// before `.fifo` for a FIFO queue: billing-work-dlq, billing-work-dlq.fifo].
    #[arg(long = "work-dlq", global = true, env = "FLEET_WORK_DLQ")]
    pub work_dlq_override: Option<String>,
    /// Shards of the work queue: work items spread over this many queues (shard 0 is the work queue,
    /// shard i is its name with `-i`, before `.fifo`: billing-work-1, billing-work-1.fifo; each with its
    /// dead-letter queue), for when one queue's limits are reached (in-flight messages, FIFO
    /// throughput). A FIFO message group stays on one shard. Every process of a fleet takes the same.
    #[arg(long, global = true, env = "FLEET_WORK_SHARDS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub work_shards: u16,
    /// Results queue (name or URL).
    #[arg(long, global = true, env = "FLEET_RESULTS_QUEUE", default_value = "billing-results")]
    pub results_queue: String,
    /// Partitions of the results queue (seed 003's partitioned consumers): each job's results, seal and
    /// dead letters travel on one partition, chosen when it is submitted (partition 0 is the results
    /// queue, partition i is its name with `-i`: billing-results-1, each with its dead-letter queue),
    /// and each partition is read by one controller at a time, so a result never reaches a controller
    /// that does not own its job. Use at least as many as controllers (a controller beyond the count
    /// stands by). Every process of a fleet takes the same; raise it at any time (jobs in flight
    /// finish on the partition they started on), lower it only once the fleet is drained.
    #[arg(long, global = true, env = "FLEET_RESULTS_PARTITIONS", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub results_partitions: u16,
    /// RabbitMQ URL for work-detected triggers; empty to disable triggers.
    #[arg(long, global = true, env = "AMQP_URL", default_value = "amqp://guest:guest@127.0.0.1:5672/%2f", hide_default_value = true, hide_env_values = true)]
    pub amqp_url: String,
    /// PEM file of the CA that signed the broker's certificate, trusted besides the system's roots
    /// (amqps:// to a broker with a private CA).
    #[arg(long = "amqp-ca-file", global = true, env = "AMQP_CA_FILE", value_name = "FILE", value_parser = AmqpCa::from_file)]
    pub amqp_ca: Option<AmqpCa>,
    /// Topic exchange of the fleet bus: work-detected triggers (`work.{queue}`) and instance reports
    /// (`report.{queue}`).
    #[arg(long, global = true, env = "FLEET_TRIGGER_EXCHANGE", default_value = "billing.fleet")]
    pub trigger_exchange: String,
    /// This process's role key (a submitter's, an operator's, a processor's): every message it sends on
    /// the work and results queues is signed with it; a controller given a keyring (`--role-keys`)
    /// counts only signed messages of the roles that may send them (docs/security.md).
    #[arg(long = "signing-key", global = true, env = "FLEET_SIGNING_KEY_FILE", value_name = "FILE", value_parser = signing_key_file)]
    pub signing_key: Option<Key>,
    #[command(flatten)]
    pub calls: CallArgs,
}

/// Debug output hides the AMQP password (the struct may end up in a log line).
impl std::fmt::Debug for FleetArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetArgs")
            .field("bucket", &self.bucket)
            .field("work_queue", &self.work_queue)
            .field("work_dlq", &self.work_dlq())
            .field("work_shards", &self.work_shards)
            .field("results_queue", &self.results_queue)
            .field("results_partitions", &self.results_partitions)
            .field("amqp_url", &redact_url(&self.amqp_url))
            .field("amqp_ca", &self.amqp_ca)
            .field("trigger_exchange", &self.trigger_exchange)
            .field("signing_key", &self.signing_key)
            .field("calls", &self.calls)
            .finish()
    }
}

impl FleetArgs {
    /// Defaults, as the CLI would give them with no flags or env (for tests and tools).
    pub fn defaults() -> FleetArgs {
        FleetArgs {
            bucket: "billing-fleet".into(),
            work_queue: "billing-work".into(),
            work_dlq_override: None,
            work_shards: 1,
            results_queue: "billing-results".into(),
            results_partitions: 1,
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            amqp_ca: None,
            trigger_exchange: "billing.fleet".into(),
            signing_key: None,
            calls: CallArgs::default(),
        }
    }

    /// The bound on every SQS, S3 and RabbitMQ call.
    pub fn call_policy(&self) -> CallPolicy {
        self.calls.policy()
    }

    /// The trigger publisher, unless triggers are off (`--amqp-url ""`).
    pub fn trigger_bus(&self) -> Option<Arc<dyn TriggerBus>> {
        (!self.amqp_url.is_empty()).then(|| {
            Arc::new(RabbitTriggers::new(&self.amqp_url, &self.trigger_exchange, self.call_policy()).with_ca(self.amqp_ca.clone())) as Arc<dyn TriggerBus>
        })
    }

    /// Subscribes to the bus with these bindings (see [`crate::trigger::work_key`]) until `shutdown`
    /// (reconnecting as needed), unless triggers are off.
    pub fn subscribe(&self, keys: Vec<String>, shutdown: &tokio_util::sync::CancellationToken) -> Option<Subscription> {
        (!self.amqp_url.is_empty()).then(|| {
            tracing::info!(url = %redact_url(&self.amqp_url), exchange = %self.trigger_exchange, ?keys, "listening for work-detected triggers");
            spawn_subscription(self.amqp_url.clone(), self.trigger_exchange.clone(), keys, self.amqp_ca.clone(), self.call_policy(), shutdown.clone())
        })
    }

    /// The work queue's dead-letter queue: `--work-dlq`, or derived from the work queue's name.
    pub fn work_dlq(&self) -> String {
        self.work_dlq_override.clone().unwrap_or_else(|| dlq_name(&self.work_queue))
    }

    /// The work queue's shards, each with its dead-letter queue: `(queue, dead-letter queue)`, shard 0
    /// first (the work queue itself and [`FleetArgs::work_dlq`]).
    pub fn work_shard_names(&self) -> Vec<(String, String)> {
        numbered(&self.work_queue, self.work_shards, self.work_dlq())
    }

    /// The results queue's partitions, each with its dead-letter queue: `(queue, dead-letter queue)`,
    /// partition 0 first (the results queue itself and [`FleetArgs::results_dlq`]).
    pub fn results_partition_names(&self) -> Vec<(String, String)> {
        numbered(&self.results_queue, self.results_partitions, self.results_dlq())
    }

    /// The same fleet with its results queue in `n` partitions.
    pub fn partitioned(&self, n: u16) -> FleetArgs {
        FleetArgs { results_partitions: n, ..self.clone() }
    }

    /// The same fleet with its work queue in `n` shards.
    pub fn sharded(&self, n: u16) -> FleetArgs {
        FleetArgs { work_shards: n, ..self.clone() }
    }

    /// The results queue's dead-letter queue (derived from its name, as provisioning creates it).
    pub fn results_dlq(&self) -> String {
        dlq_name(&self.results_queue)
    }

    /// The same fleet on a FIFO work queue (`{work_queue}.fifo`, its dead-letter queue derived).
    pub fn fifo(&self) -> FleetArgs {
        let work_queue = if is_fifo(&self.work_queue) { self.work_queue.clone() } else { format!("{}.fifo", self.work_queue) };
        FleetArgs { work_queue, work_dlq_override: None, ..self.clone() }
    }

    /// Same names with a suffix on every queue, bucket and exchange (isolated test fleets).
    pub fn with_suffix(&self, suffix: &str) -> FleetArgs {
        FleetArgs {
            bucket: format!("{}-{suffix}", self.bucket),
            work_queue: suffixed(&self.work_queue, suffix),
            work_dlq_override: self.work_dlq_override.as_deref().map(|q| suffixed(q, suffix)),
            work_shards: self.work_shards,
            results_queue: suffixed(&self.results_queue, suffix),
            results_partitions: self.results_partitions,
            amqp_url: self.amqp_url.clone(),
            amqp_ca: self.amqp_ca.clone(),
            trigger_exchange: format!("{}-{suffix}", self.trigger_exchange),
            signing_key: self.signing_key.clone(),
            calls: self.calls,
        }
    }
}

/// Whether a queue name or URL names a FIFO queue (SQS requires the `.fifo` suffix).
pub fn is_fifo(name_or_url: &str) -> bool {
    name_or_url.ends_with(".fifo")
}

/// The dead-letter queue name for a queue: `-dlq` appended, before `.fifo` for a FIFO queue (a FIFO
/// queue's dead-letter queue must be FIFO too). Works on names and URLs alike.
pub fn dlq_name(queue: &str) -> String {
    suffixed(queue, "dlq")
}

/// `n` queues named after `first` (itself, then `first-1`, `first-2`, ...), each with its dead-letter
/// queue (`first_dlq` for the first, derived for the others).
fn numbered(first: &str, n: u16, first_dlq: String) -> Vec<(String, String)> {
    let mut out = vec![(first.to_string(), first_dlq)];
    for i in 1..n.max(1) {
        let q = suffixed(first, &i.to_string());
        let dlq = dlq_name(&q);
        out.push((q, dlq));
    }
    out
}

/// `name-suffix`, keeping `.fifo` last.
fn suffixed(name: &str, suffix: &str) -> String {
    match name.strip_suffix(".fifo") {
        Some(base) => format!("{base}-{suffix}.fifo"),
        None => format!("{name}-{suffix}"),
    }
}

/// Logging flags.
#[derive(Debug, Clone, clap::Args)]
pub struct LogArgs {
    /// Log as JSON lines instead of text (filter with RUST_LOG).
    #[arg(long, global = true, env = "LOG_JSON")]
    pub log_json: bool,
}

/// Loaded AWS configuration and the endpoint it talks to (for error messages).
#[derive(Clone)]
pub struct Aws {
    pub sdk: SdkConfig,
    /// AWS_ENDPOINT_URL, or a description of the AWS default endpoint.
    pub endpoint: String,
    custom_endpoint: bool,
    /// Bounds every call of the queues and stores made here (the SDK's own retries are off).
    pub policy: CallPolicy,
    /// SQS's and S3's breakers, shared by every queue and store made here.
    pub breakers: Breakers,
}

impl Aws {
    /// Loads the standard AWS configuration chain.
    pub async fn load() -> Aws {
        let sdk = aws_config::defaults(BehaviorVersion::latest())
            .timeout_config(TimeoutConfig::builder().connect_timeout(Duration::from_secs(3)).build())
            .retry_config(RetryConfig::disabled())
            .load()
            .await;
        let custom_endpoint = sdk.endpoint_url().is_some();
        let endpoint = match sdk.endpoint_url() {
            Some(u) => u.to_string(),
            None => format!("the AWS endpoint for region {}", sdk.region().map(|r| r.to_string()).unwrap_or_else(|| "(none set)".into())),
        };
        Aws { sdk, endpoint, custom_endpoint, policy: CallPolicy::default(), breakers: Breakers::default() }
    }

    /// Checks what every call needs and the SDK would find missing only at the first call, after its
    /// lookups: a region and credentials. Each missing one is said in a line that says what to set.
    pub async fn check_identity(&self, within: Duration) -> Result<()> {
        use aws_sdk_sqs::config::ProvideCredentials;
        if self.sdk.region().is_none() {
            return Err(Error::Config("no AWS region: set AWS_REGION (e.g. us-east-1), or a region in your AWS profile".into()));
        }
        let missing =
            || Error::Config("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (any values for LocalStack), or AWS_PROFILE".into());
        let provider = self.sdk.credentials_provider().ok_or_else(missing)?;
        match tokio::time::timeout(within, provider.provide_credentials()).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(missing()),
        }
    }

    /// The same configuration with every call bounded by `policy`.
    pub fn with_policy(self, policy: CallPolicy) -> Aws {
        Aws { policy, ..self }
    }

    /// Configuration for a local stack at `endpoint` with static test credentials, unless the standard
    /// environment already names an endpoint (then that environment is used as is).
    pub async fn local_or_env(endpoint: &str) -> Aws {
        if std::env::var_os("AWS_ENDPOINT_URL").is_some() {
            return Aws::load().await;
        }
        Aws::local(endpoint).await
    }

    /// Configuration for a local stack at `endpoint` with static test credentials, whatever the
    /// environment says (a test that started its own stack).
    pub async fn local(endpoint: &str) -> Aws {
        let sdk = aws_config::defaults(BehaviorVersion::latest())
            .endpoint_url(endpoint)
            .region(aws_config::Region::new("us-east-1"))
            .credentials_provider(aws_sdk_sqs::config::Credentials::new("test", "test", None, None, "static"))
            .timeout_config(TimeoutConfig::builder().connect_timeout(Duration::from_secs(3)).build())
            .retry_config(RetryConfig::disabled())
            .load()
            .await;
        Aws { sdk, endpoint: endpoint.to_string(), custom_endpoint: true, policy: CallPolicy::default(), breakers: Breakers::default() }
    }

    pub fn sqs(&self) -> aws_sdk_sqs::Client {
        aws_sdk_sqs::Client::new(&self.sdk)
    }

    pub fn s3(&self) -> aws_sdk_s3::Client {
        // LocalStack and most S3 look-alikes need path-style addressing.
        let conf = aws_sdk_s3::config::Builder::from(&self.sdk).force_path_style(self.custom_endpoint).build();
        aws_sdk_s3::Client::from_conf(conf)
    }

    pub async fn queue(&self, name_or_url: &str) -> Result<Arc<SqsQueue>> {
        self.queue_within(name_or_url, self.policy).await
    }

    /// A queue whose lookup (GetQueueUrl, its first call) is bounded by `first` (e.g. a short bound
    /// for an interactive command, so an unreachable endpoint is said at once); its later calls by
    /// this configuration's policy.
    pub async fn queue_within(&self, name_or_url: &str, first: CallPolicy) -> Result<Arc<SqsQueue>> {
        let q = SqsQueue::open(self.sqs(), &self.endpoint, name_or_url, first).await?.with_policy(self.policy);
        Ok(Arc::new(q.with_breaker(self.breakers.sqs.clone())))
    }

    /// Queues and their dead-letter queues, opened at once (lookups bounded by `first`); the queues count
    /// their calls into one counter, their dead-letter queues into another. A missing one is said with
    /// `hint` (where the count came from and what creates them) when there are several.
    async fn open_pairs(&self, names: Vec<(String, String)>, first: CallPolicy, hint: &str) -> Result<Vec<(Arc<SqsQueue>, Arc<SqsQueue>)>> {
        let (calls, dlq_calls) = (CallCounter::default(), CallCounter::default());
        let several = names.len() > 1;
        let open = |name: String, calls: CallCounter| async move {
            let q = SqsQueue::open(self.sqs(), &self.endpoint, &name, first).await?.with_policy(self.policy).counting_into(&calls);
            Ok::<_, Error>(Arc::new(q.with_breaker(self.breakers.sqs.clone())))
        };
        // Looked up at once: a fleet of 64 shards starts as fast as one of one.
        let pairs = names.into_iter().map(|(q, dlq)| futures::future::try_join(open(q, calls.clone()), open(dlq, dlq_calls.clone())));
        futures::future::try_join_all(pairs).await.map_err(|e| match e {
            Error::NotFound { service, what } if several => Error::NotFound { service, what: format!("{what} ({hint}; `initiator provision` creates them)") },
            e => e,
        })
    }

    /// The work queue's shards and their dead-letter queues, opened (lookups bounded by `first`); the
    /// shards count their calls into one counter, their dead-letter queues into another.
    pub async fn work_shards(&self, fleet: &FleetArgs, first: CallPolicy) -> Result<Vec<(Arc<SqsQueue>, Arc<SqsQueue>)>> {
        let hint = format!("the work queue is in {} shards: --work-shards / FLEET_WORK_SHARDS", fleet.work_shards);
        self.open_pairs(fleet.work_shard_names(), first, &hint).await
    }

    /// The work queue and its dead-letter queue, each one queue to its users: the queue itself, or its
    /// shards as one [`Sharded`] queue when `--work-shards` is over 1.
    pub async fn work_queues(&self, fleet: &FleetArgs, first: CallPolicy) -> Result<(Arc<dyn Queue>, Arc<dyn Queue>)> {
        Sharded::pairs(&self.work_shards(fleet, first).await?)
    }

    /// The results queue and its dead-letter queue, each one queue to its users: the queue itself, or
    /// its partitions as one [`Sharded`] queue when `--results-partitions` is over 1 (senders pick a
    /// job's partition with [`crate::queue::partition`]; its depth is the partitions' sum).
    pub async fn results_queues(&self, fleet: &FleetArgs, first: CallPolicy) -> Result<(Arc<dyn Queue>, Arc<dyn Queue>)> {
        Sharded::pairs(&self.open_results_partitions(fleet, first).await?)
    }

    /// The results queue's partitions and their dead-letter queues, opened (lookups bounded by `first`).
    pub async fn open_results_partitions(&self, fleet: &FleetArgs, first: CallPolicy) -> Result<Vec<(Arc<SqsQueue>, Arc<SqsQueue>)>> {
        let hint = format!("the results queue is in {} partitions: --results-partitions / FLEET_RESULTS_PARTITIONS", fleet.results_partitions);
        self.open_pairs(fleet.results_partition_names(), first, &hint).await
    }

    pub fn store(&self, bucket: &str) -> Arc<S3Store> {
        Arc::new(S3Store::new(self.s3(), &self.endpoint, bucket, self.policy).with_breaker(self.breakers.s3.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_names_keep_fifo_last() {
        assert_eq!(dlq_name("billing-work"), "billing-work-dlq");
        assert_eq!(dlq_name("billing-work.fifo"), "billing-work-dlq.fifo");
        assert_eq!(dlq_name("http://h:4566/000000000000/q.fifo"), "http://h:4566/000000000000/q-dlq.fifo");
        let d = FleetArgs::defaults();
        assert_eq!(d.work_dlq(), "billing-work-dlq");
        let f = d.fifo();
        assert_eq!((f.work_queue.as_str(), f.work_dlq().as_str()), ("billing-work.fifo", "billing-work-dlq.fifo"));
        let s = f.with_suffix("t1");
        assert_eq!(
            (s.work_queue.as_str(), s.work_dlq().as_str(), s.results_queue.as_str()),
            ("billing-work-t1.fifo", "billing-work-t1-dlq.fifo", "billing-results-t1")
        );
        let o = FleetArgs { work_dlq_override: Some("mine".into()), ..d };
        assert_eq!(o.with_suffix("t1").work_dlq(), "mine-t1");
    }

    #[test]
    fn bucket_names_are_checked_as_s3_checks_them() {
        for good in ["billing-fleet", "abc", "a.b-c.9", &"x".repeat(63)] {
            assert_eq!(bucket_name(good).as_deref(), Ok(good));
        }
        for (bad, says) in
            [("", "3 to 63"), ("ab", "3 to 63"), ("Billing", "'B' is not allowed"), ("a_b-c", "'_'"), ("-abc", "begin and end"), ("abc.", "begin and end")]
        {
            let e = bucket_name(bad).unwrap_err();
            assert!(e.contains(says) && e.contains(&format!("{bad:?}")), "{bad:?}: {e}");
        }
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            fleet: FleetArgs,
        }
        let e = <Only as clap::Parser>::try_parse_from(["x", "--bucket", ""]).err().expect("an empty bucket is refused").to_string();
        assert!(e.contains("--bucket") && e.contains("bucket name \"\": must have 3 to 63 characters"), "{e}");
    }

    #[test]
    fn the_signing_key_is_read_from_its_file_and_a_bad_one_is_named() {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            fleet: FleetArgs,
        }
        let dir = std::env::temp_dir().join(format!("fleet-signing-key-{}-{}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = crate::auth::Key::generate(crate::auth::Role::Processor);
        let good = dir.join("processor.key");
        std::fs::write(&good, key.to_line()).unwrap();
        let parsed = <Only as clap::Parser>::try_parse_from(["x", "--signing-key", good.to_str().unwrap()]).unwrap().fleet;
        let got = parsed.signing_key.as_ref().expect("the key");
        assert_eq!((got.role(), got.id()), (crate::auth::Role::Processor, key.id()));
        // The same signature as the key it was written from.
        assert_eq!(got.sign("body"), key.sign("body"));
        // Shown by role and id, never the secret.
        let shown = format!("{parsed:?}");
        assert!(shown.contains(&format!("Key(processor {}, ***)", key.id())) && !shown.contains(key.to_line().split_whitespace().nth(1).unwrap()), "{shown}");
        assert!(<Only as clap::Parser>::try_parse_from(["x"]).unwrap().fleet.signing_key.is_none());
        assert!(FleetArgs::defaults().signing_key.is_none());
        let bad = dir.join("bad.key");
        std::fs::write(&bad, "boss AAAA").unwrap();
        for (path, says) in [(bad.clone(), "line 1: unknown role"), (dir.join("missing.key"), "cannot read the key")] {
            let e = <Only as clap::Parser>::try_parse_from(["x", "--signing-key", path.to_str().unwrap()]).err().expect("refused").to_string();
            assert!(e.contains("--signing-key") && e.contains(&format!("signing key {}: {says}", path.display())), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debug_output_hides_the_amqp_password() {
        let f = FleetArgs { amqp_url: "amqp://fleet:s3cret-pw@rabbit:5672/%2f".into(), ..FleetArgs::defaults() };
        let shown = format!("{f:?}");
        assert!(!shown.contains("s3cret-pw"), "{shown}");
        assert!(shown.contains("amqp://fleet:***@rabbit:5672/%2f"), "{shown}");
    }
}
