//! What the controllers conclude and measure, heard from their own tracing events. A controller that
//! finds itself fenced (its lease lost, its checkpoint written by another controller) says so; in a
//! run with one controller under one name nobody else can have written, so such a conclusion is wrong
//! (a write whose answer was lost and that met itself when tried again, taken for another's). A
//! controller that inflates a result payload says how many bytes it holds and the share of its decode
//! budget reserved for it (`Memory`): more than the share breaks the budget.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// The conclusions heard, each as "message (fields)".
#[derive(Clone, Default)]
pub struct Heard(pub Arc<Mutex<Vec<String>>>);

/// The job a conclusion names (its `job` field).
pub fn job_of(heard: &str) -> Option<&str> {
    let rest = &heard[heard.find("job=")? + 4..];
    Some(rest.split_whitespace().next()?.trim_matches('"'))
}

/// What a controller says when it concludes that another controller owns a job now.
const FENCED: [&str; 4] = ["fenced", "lease lost", "written by another controller", "another controller, just now"];

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }
}

impl<S: Subscriber> Layer<S> for Heard {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() > tracing::Level::INFO {
            return;
        }
        let mut f = Fields(String::new());
        event.record(&mut f);
        if FENCED.iter().any(|w| f.0.contains(w)) {
            fleet_io::lock(&self.0).push(f.0.trim().to_string());
        }
    }
}

/// The payloads inflated beyond the budget share reserved for them, each as (bytes held, share), the
/// most bytes any one inflated payload held, and the largest share any decode reserved (never more
/// than the whole budget: a result that could decode past it is refused).
#[derive(Clone, Default)]
pub struct Memory {
    pub over: Arc<Mutex<Vec<(u64, u64)>>>,
    pub most: Arc<std::sync::atomic::AtomicU64>,
    pub widest: Arc<std::sync::atomic::AtomicU64>,
}

struct Sizes {
    held: Option<u64>,
    share: Option<u64>,
}

impl Visit for Sizes {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "held" => self.held = Some(value),
            "share" => self.share = Some(value),
            _ => {}
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for Memory {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != controller::aggregate::MEMORY_TARGET {
            return;
        }
        let mut s = Sizes { held: None, share: None };
        event.record(&mut s);
        if let (Some(held), Some(share)) = (s.held, s.share) {
            self.most.fetch_max(held, std::sync::atomic::Ordering::Relaxed);
            self.widest.fetch_max(share, std::sync::atomic::Ordering::Relaxed);
            if held > share {
                fleet_io::lock(&self.over).push((held, share));
            }
        }
    }
}

/// Who reads which results partition, from the answers of their receives: a controller reads a queue
/// in runs, while its receives keep getting answers (at least every [`crate::READ_WINDOW`]). Two live
/// controllers whose runs on one partition overlap (neither paused just before: a paused process's
/// receive is answered after its pause) are *co-reading*; `longest` is the longest such overlap,
/// from the later run's start to the earlier of their last answers. (It once chained every answer
/// within a window of the other's last into one stretch, so hand-overs 10-25 s apart, each
/// legitimate, read as one co-read of a minute: seeds 471546826 and 471549780.)
#[derive(Default)]
pub struct Readers {
    /// Per queue, per controller: its last answer, its process and its faults.
    last: std::collections::BTreeMap<String, std::collections::BTreeMap<usize, Reader>>,
    longest: Option<(std::time::Duration, String)>,
}

/// A controller's last answer from a queue: when, its process, its faults, and when its current run
/// of answers began.
type Reader = (tokio::time::Instant, crate::faults::Life, Arc<Mutex<crate::faults::Faults>>, tokio::time::Instant);

/// A receive's answer: on which queue, to which controller (its process and faults), when (also as
/// the run's time).
pub struct Answer<'a> {
    pub queue: &'a str,
    pub ctl: usize,
    pub life: &'a crate::faults::Life,
    pub faults: &'a Arc<Mutex<crate::faults::Faults>>,
    pub now: tokio::time::Instant,
    pub run_time: std::time::Duration,
}

impl Readers {
    pub fn read(&mut self, a: Answer<'_>, paused: impl Fn(&Arc<Mutex<crate::faults::Faults>>) -> bool) {
        let Answer { queue, ctl, life, faults, now, run_time } = a;
        let readers = self.last.entry(queue.to_string()).or_default();
        // The run goes on while answers come within the window, in one process.
        let since = match readers.get(&ctl) {
            Some((at, l, _, since)) if now.saturating_duration_since(*at) <= crate::READ_WINDOW && l.same(life) => *since,
            _ => now,
        };
        readers.insert(ctl, (now, life.clone(), faults.clone(), since));
        if paused(faults) {
            return;
        }
        let others: Vec<(usize, tokio::time::Instant, tokio::time::Instant)> = readers
            .iter()
            .filter(|(j, (at, life, f, _))| **j != ctl && !life.ended() && now.saturating_duration_since(*at) <= crate::READ_WINDOW && !paused(f))
            .map(|(j, (at, _, _, s))| (*j, *at, *s))
            .collect();
        for (j, their_last, their_since) in others {
            // Both read from the later run's start at least until the other's last answer.
            let start = since.max(their_since);
            let d = their_last.saturating_duration_since(start);
            if d > std::time::Duration::ZERO && self.longest.as_ref().is_none_or(|(l, _)| d > *l) {
                let from = run_time.saturating_sub(now.saturating_duration_since(start)).as_secs_f64();
                self.longest = Some((d, format!("ctl{} and ctl{} both read {queue} from {from:.1} s", ctl.min(j), ctl.max(j))));
            }
        }
    }

    /// When controller `ctl` last got an answer from `queue`.
    pub fn last_read(&self, queue: &str, ctl: usize) -> Option<tokio::time::Instant> {
        self.last.get(queue)?.get(&ctl).map(|(at, _, _, _)| *at)
    }

    pub fn longest(&self) -> Option<(std::time::Duration, String)> {
        self.longest.clone()
    }
}

/// The partitions each controller was told to stop reading by a balancing round, and when: a
/// controller stops receiving from all of them at once, so that none is read a receive's wait after
/// the round (the `stop-at-once` fix); one it starts reading again is taken off.
#[derive(Clone, Default)]
pub struct Stops(
    pub Arc<Mutex<std::collections::BTreeMap<(String, u16), tokio::time::Instant>>>,
    /// When each controller (by owner) last gained a partition.
    pub Arc<Mutex<std::collections::BTreeMap<String, tokio::time::Instant>>>,
    /// When each controller (by owner) stopped reading because its membership went stale.
    pub Arc<Mutex<Vec<(String, tokio::time::Instant)>>>,
);

#[derive(Default)]
struct PartitionEvent {
    owner: Option<String>,
    partition: Option<u16>,
    partitions: Vec<u16>,
    change: Option<String>,
    stale: bool,
}

impl Visit for PartitionEvent {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "owner" => self.owner = Some(value.to_string()),
            "change" => self.change = Some(value.to_string()),
            _ => {}
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "stale" {
            self.stale = value;
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "partition" {
            self.partition = u16::try_from(value).ok();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "partitions" {
            let text = format!("{value:?}");
            self.partitions = text.trim_matches(|c| c == '[' || c == ']').split(',').filter_map(|p| p.trim().parse().ok()).collect();
        }
    }
}

impl<S: Subscriber> Layer<S> for Stops {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != controller::events::PARTITIONS_TARGET {
            return;
        }
        let mut e = PartitionEvent::default();
        event.record(&mut e);
        let Some(owner) = e.owner else { return };
        let mut stops = fleet_io::lock(&self.0);
        match (e.change.as_deref(), e.partition) {
            (Some("gained"), Some(p)) => {
                fleet_io::lock(&self.1).insert(owner.clone(), tokio::time::Instant::now());
                stops.remove(&(owner, p));
            }
            (None, _) => {
                let now = tokio::time::Instant::now();
                if e.stale && !e.partitions.is_empty() {
                    fleet_io::lock(&self.2).push((owner.clone(), now));
                }
                for p in e.partitions {
                    stops.entry((owner.clone(), p)).or_insert(now);
                }
            }
            _ => {}
        }
    }
}

/// Takeovers seen in the store's writes, checked against the time the previous holder may still act
/// (issue 58, times judged on one clock): a job's lease written by a new owner, or a member dropped
/// from the partition table by a peer, while the holder's last write of it is younger than two
/// thirds of a lease on the simulation's clock (a holder acts on what it wrote for that long,
/// `Leases::fresh`, `Ownership::fresh`; whatever the controllers' wall clocks say, nothing may be
/// taken from it before). Given-back leases and members that leave on their own are free at once.
pub struct Takeovers {
    ttl: std::time::Duration,
    /// Per job: the lease's owner and epoch as last written, whether given back, and when.
    leases: std::collections::BTreeMap<String, (String, u64, bool, tokio::time::Instant, std::time::Duration)>,
    /// The partition table's members as last written, and when each last renewed itself.
    members: std::collections::BTreeSet<String>,
    renewed: std::collections::BTreeMap<String, tokio::time::Instant>,
    /// Each member's lease as it last declared it in the table (a misconfigured one's differs).
    member_lease: std::collections::BTreeMap<String, std::time::Duration>,
    pub violations: Vec<String>,
}

impl Takeovers {
    pub fn new(ttl: std::time::Duration) -> Takeovers {
        Takeovers {
            ttl,
            leases: Default::default(),
            members: Default::default(),
            renewed: Default::default(),
            member_lease: Default::default(),
            violations: Vec::new(),
        }
    }

    /// A write of job `job`'s lease landed (`body` as written) at `now`, `run_time` into the run.
    pub fn lease(&mut self, job: &str, body: &[u8], now: tokio::time::Instant, run_time: std::time::Duration) {
        let Ok(doc) = serde_json::from_slice::<serde_json::Value>(body) else { return };
        let (Some(owner), Some(epoch), Some(expires)) = (doc["owner"].as_str(), doc["epoch"].as_u64(), doc["expires_ms"].as_u64()) else { return };
        // The writer's own lease: it acts on what it wrote for two thirds of it.
        let its_lease = doc["lease_ms"].as_u64().map_or(self.ttl, std::time::Duration::from_millis);
        if let Some((prev, prev_epoch, released, at, prev_lease)) = self.leases.get(job) {
            let age = now.saturating_duration_since(*at);
            if prev != owner && epoch > *prev_epoch && !released && age < *prev_lease * 2 / 3 {
                self.violations.push(format!(
                    "{owner} took job {job}'s lease at {:.1} s, {:.1} s after {prev} last wrote it (it may act on it for {:.0} s)",
                    run_time.as_secs_f64(),
                    age.as_secs_f64(),
                    (*prev_lease * 2 / 3).as_secs_f64()
                ));
            }
        }
        self.leases.insert(job.to_string(), (owner.to_string(), epoch, expires == 0, now, its_lease));
    }

    /// `writer` wrote the partition table (`body`) at `now`.
    pub fn table(&mut self, writer: &str, body: &[u8], now: tokio::time::Instant, run_time: std::time::Duration) {
        let Ok(t) = serde_json::from_slice::<controller::partitions::Table>(body) else { return };
        let members: std::collections::BTreeSet<String> = t.members.keys().cloned().collect();
        for gone in self.members.difference(&members).filter(|m| m.as_str() != writer) {
            if let Some(at) = self.renewed.get(gone) {
                let age = now.saturating_duration_since(*at);
                let its = self.member_lease.get(gone).copied().unwrap_or(self.ttl);
                if age < its * 2 / 3 {
                    self.violations.push(format!(
                        "{writer} dropped member {gone} at {:.1} s, {:.1} s after it last renewed (it reads its partitions for {:.0} s)",
                        run_time.as_secs_f64(),
                        age.as_secs_f64(),
                        (its * 2 / 3).as_secs_f64()
                    ));
                }
            }
        }
        if members.contains(writer) {
            self.renewed.insert(writer.to_string(), now);
            if let Some(ms) = t.leases.get(writer) {
                self.member_lease.insert(writer.to_string(), std::time::Duration::from_millis(*ms));
            }
        }
        self.members = members;
    }
}
