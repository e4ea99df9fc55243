//! Request accounting, typed from the call to the report. [`Op`] names one operation of one service;
//! [`Billed`] is what the services bill (an attempt of an operation, on a standard or a FIFO queue, or
//! SQS's further 64 KiB chunks of a payload); [`RequestCounts`] counts a job's requests by `Billed`.
//!
//! The clients count every attempt they make where they make it (`fleet_io::call::CallCounter`, by
//! `Billed`), and a task's share is read off the same counts (`fleet_io::call::counted`): nobody
//! counts a request by hand. Counts travel in work results and checkpoints under [`Billed::name`]
//! (`sqs.ReceiveMessage`, `sqs.fifo.ReceiveMessage`, `s3.GetObject`, `sqs.Extra64KiBChunks`), the
//! same names as before they were typed, and are read back into `Billed`; the price table
//! (`crate::prices`) reads the type. How a request is attributed to a job is in `docs/requests.md`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Which external service a call goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Service {
    Sqs,
    S3,
    RabbitMq,
}

impl Service {
    /// The service as a metric label and a billed name's prefix: `sqs`, `s3`, `amqp`.
    pub const fn key(self) -> &'static str {
        match self {
            Service::Sqs => "sqs",
            Service::S3 => "s3",
            Service::RabbitMq => "amqp",
        }
    }
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Service::Sqs => "SQS",
            Service::S3 => "S3",
            Service::RabbitMq => "RabbitMQ",
        })
    }
}

macro_rules! ops {
    ($($variant:ident => $service:ident $name:literal,)*) => {
        /// One operation of one service.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Op {
            $(#[doc = $name] $variant,)*
        }

        impl Op {
            /// Every operation, in declaration order.
            pub const ALL: &'static [Op] = &[$(Op::$variant),*];

            /// The service it is of.
            pub const fn service(self) -> Service {
                match self {
                    $(Op::$variant => Service::$service,)*
                }
            }

            /// The operation's name as the service's API spells it (`ReceiveMessage`, `basic.publish`).
            pub const fn name(self) -> &'static str {
                match self {
                    $(Op::$variant => $name,)*
                }
            }
        }
    };
}

ops! {
    SqsGetQueueUrl => Sqs "GetQueueUrl",
    SqsGetQueueAttributes => Sqs "GetQueueAttributes",
    SqsSendMessageBatch => Sqs "SendMessageBatch",
    SqsReceiveMessage => Sqs "ReceiveMessage",
    SqsDeleteMessageBatch => Sqs "DeleteMessageBatch",
    SqsChangeMessageVisibilityBatch => Sqs "ChangeMessageVisibilityBatch",
    SqsStartMessageMoveTask => Sqs "StartMessageMoveTask",
    SqsListMessageMoveTasks => Sqs "ListMessageMoveTasks",
    SqsCreateQueue => Sqs "CreateQueue",
    SqsSetQueueAttributes => Sqs "SetQueueAttributes",
    S3HeadBucket => S3 "HeadBucket",
    S3CreateBucket => S3 "CreateBucket",
    S3PutBucketLifecycleConfiguration => S3 "PutBucketLifecycleConfiguration",
    S3GetObject => S3 "GetObject",
    S3PutObject => S3 "PutObject",
    S3HeadObject => S3 "HeadObject",
    S3ListObjectsV2 => S3 "ListObjectsV2",
    S3DeleteObject => S3 "DeleteObject",
    AmqpConnect => RabbitMq "connect",
    AmqpPublish => RabbitMq "basic.publish",
}

impl fmt::Display for Op {
    /// `sqs.ReceiveMessage`, `s3.GetObject`, `amqp.basic.publish`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.service().key(), self.name())
    }
}

/// Payload bytes SQS bills as one request.
pub const SQS_BILLING_CHUNK: usize = 64 * 1024;

/// The requests SQS bills for one call carrying `bytes` of payload beyond the first: `ceil(bytes /
/// 64 KiB) - 1`.
pub fn sqs_extra_chunks(bytes: usize) -> u64 {
    (bytes.div_ceil(SQS_BILLING_CHUNK) as u64).saturating_sub(1)
}

/// A request the services bill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Billed {
    /// A call (an attempt: a retried call is billed again) of `op`, on a FIFO queue when `fifo`.
    Call { op: Op, fifo: bool },
    /// SQS's further 64 KiB chunks of a call's payload (each billed as one more request).
    Extra64KiB { fifo: bool },
}

impl Billed {
    /// A call of `op` on a standard queue (or of a service without FIFO queues).
    pub const fn call(op: Op) -> Billed {
        Billed::Call { op, fifo: false }
    }

    /// The service that bills it.
    pub const fn service(self) -> Service {
        match self {
            Billed::Call { op, .. } => op.service(),
            Billed::Extra64KiB { .. } => Service::Sqs,
        }
    }

    /// On a FIFO queue (billed at SQS's FIFO price).
    pub const fn fifo(self) -> bool {
        match self {
            Billed::Call { fifo, .. } | Billed::Extra64KiB { fifo } => fifo,
        }
    }

    /// Its name within its service, as a report lists it: `ReceiveMessage`, `fifo.ReceiveMessage`,
    /// `Extra64KiBChunks`.
    pub fn op_name(self) -> String {
        let fifo = if self.fifo() { "fifo." } else { "" };
        match self {
            Billed::Call { op, .. } => format!("{fifo}{}", op.name()),
            Billed::Extra64KiB { .. } => format!("{fifo}Extra64KiBChunks"),
        }
    }

    /// The name its counts travel under: `sqs.ReceiveMessage`, `sqs.fifo.ReceiveMessage`,
    /// `s3.GetObject`, `sqs.Extra64KiBChunks`, `sqs.fifo.Extra64KiBChunks`.
    pub fn name(self) -> String {
        format!("{}.{}", self.service().key(), self.op_name())
    }

    /// Every billed request there is, in order.
    pub fn all() -> impl Iterator<Item = Billed> {
        let calls = Op::ALL.iter().flat_map(|&op| {
            let fifo = op.service() == Service::Sqs;
            std::iter::once(Billed::call(op)).chain(fifo.then_some(Billed::Call { op, fifo: true }))
        });
        calls.chain([Billed::Extra64KiB { fifo: false }, Billed::Extra64KiB { fifo: true }])
    }
}

impl fmt::Display for Billed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl FromStr for Billed {
    type Err = String;

    /// A [`Billed::name`] read back (every result and checkpoint read parses a few: from a table
    /// of the names made once, not by formatting each candidate's).
    fn from_str(s: &str) -> Result<Billed, String> {
        static BY_NAME: std::sync::LazyLock<std::collections::HashMap<String, Billed>> =
            std::sync::LazyLock::new(|| Billed::all().map(|b| (b.name(), b)).collect());
        BY_NAME.get(s).copied().ok_or_else(|| format!("'{s}' is not a billed request"))
    }
}

/// A job's requests, by what is billed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestCounts(BTreeMap<Billed, u64>);

impl RequestCounts {
    /// Adds `n` of `what` (saturating: counts come from queue messages and must never wrap).
    pub fn add(&mut self, what: Billed, n: u64) {
        if n > 0 {
            let c = self.0.entry(what).or_default();
            *c = c.saturating_add(n);
        }
    }

    pub fn merge(&mut self, other: &RequestCounts) {
        for (k, v) in &other.0 {
            self.add(*k, *v);
        }
    }

    /// Takes back counts merged before (counted elsewhere already); a count that reaches zero is
    /// not kept.
    pub fn sub(&mut self, other: &RequestCounts) {
        for (k, v) in &other.0 {
            if let Some(c) = self.0.get_mut(k) {
                *c = c.saturating_sub(*v);
                if *c == 0 {
                    self.0.remove(k);
                }
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.0.values().fold(0u64, |n, v| n.saturating_add(*v))
    }

    /// How many of `what`.
    pub fn of(&self, what: Billed) -> u64 {
        self.0.get(&what).copied().unwrap_or(0)
    }

    /// How many calls of `op` (on a standard queue, or a service without FIFO queues).
    pub fn calls(&self, op: Op) -> u64 {
        self.of(Billed::call(op))
    }

    /// Every count, in order.
    pub fn iter(&self) -> impl Iterator<Item = (Billed, u64)> + '_ {
        self.0.iter().map(|(k, v)| (*k, *v))
    }

    /// The counts of one service, by their name within it ([`Billed::op_name`]), as a report lists
    /// them.
    pub fn by_service(&self, service: Service) -> BTreeMap<String, u64> {
        self.0.iter().filter(|(k, _)| k.service() == service).map(|(k, v)| (k.op_name(), *v)).collect()
    }
}

impl FromIterator<(Billed, u64)> for RequestCounts {
    fn from_iter<I: IntoIterator<Item = (Billed, u64)>>(iter: I) -> Self {
        let mut c = RequestCounts::default();
        for (k, v) in iter {
            c.add(k, v);
        }
        c
    }
}

impl Serialize for RequestCounts {
    /// A map of [`Billed::name`] to count, in the names' order, as counts travelled before they were
    /// typed.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let named: BTreeMap<String, u64> = self.0.iter().map(|(k, v)| (k.name(), *v)).collect();
        named.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RequestCounts {
    /// The map [`Serialize`] writes. A name this release does not bill (a later release's) is left
    /// out rather than failing the message or checkpoint that carries it: counts are what the job
    /// cost, never what it bills its customers.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let named = BTreeMap::<String, u64>::deserialize(d)?;
        Ok(named.into_iter().filter_map(|(k, v)| Some((k.parse::<Billed>().ok()?, v))).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_and_group_by_service() {
        let mut a = RequestCounts::default();
        a.add(Billed::call(Op::SqsReceiveMessage), 2);
        a.add(Billed::call(Op::S3GetObject), 3);
        let mut b = RequestCounts::default();
        b.add(Billed::call(Op::SqsReceiveMessage), 1);
        b.add(Billed::call(Op::SqsDeleteMessageBatch), 0);
        a.merge(&b);
        assert_eq!(a.total(), 6);
        assert_eq!(a.by_service(Service::Sqs).values().sum::<u64>(), 3);
        assert_eq!(a.by_service(Service::S3).get("GetObject"), Some(&3));
        assert_eq!(a.calls(Op::SqsDeleteMessageBatch), 0);
        assert!(a.iter().all(|(k, _)| k != Billed::call(Op::SqsDeleteMessageBatch)), "a zero is not kept");
    }

    #[test]
    fn names_are_the_apis_and_read_back() {
        assert_eq!(Op::SqsReceiveMessage.to_string(), "sqs.ReceiveMessage");
        assert_eq!(Op::AmqpPublish.to_string(), "amqp.basic.publish");
        assert_eq!(Billed::Call { op: Op::SqsDeleteMessageBatch, fifo: true }.name(), "sqs.fifo.DeleteMessageBatch");
        assert_eq!(Billed::call(Op::S3PutObject).name(), "s3.PutObject");
        assert_eq!(Billed::Extra64KiB { fifo: false }.name(), "sqs.Extra64KiBChunks");
        assert_eq!(Billed::Extra64KiB { fifo: true }.op_name(), "fifo.Extra64KiBChunks");
        let names: Vec<String> = Billed::all().map(Billed::name).collect();
        let distinct: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "two billed requests with one name");
        for b in Billed::all() {
            assert_eq!(b.name().parse::<Billed>(), Ok(b), "{b} reads back");
        }
        assert!("sqs.Teleport".parse::<Billed>().is_err());
        assert_eq!((sqs_extra_chunks(0), sqs_extra_chunks(1), sqs_extra_chunks(65_536), sqs_extra_chunks(65_537), sqs_extra_chunks(262_144)), (0, 0, 0, 1, 3));
    }

    /// Counts travel as they did before they were typed (a checkpoint or result written by the last
    /// release reads back the same), and a name this release does not know is left out.
    #[test]
    fn counts_travel_under_their_names() {
        let mut c = RequestCounts::default();
        c.add(Billed::Call { op: Op::SqsReceiveMessage, fifo: true }, 2);
        c.add(Billed::Extra64KiB { fifo: false }, 1);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, r#"{"sqs.Extra64KiBChunks":1,"sqs.fifo.ReceiveMessage":2}"#);
        let back: RequestCounts = serde_json::from_str(r#"{"sqs.Extra64KiBChunks":1,"sqs.fifo.ReceiveMessage":2,"sqs.Teleport":9}"#).unwrap();
        assert_eq!(back, c);
    }
}
