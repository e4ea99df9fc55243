//! The operations the fleet calls on SQS, S3 and RabbitMQ, typed: every bounded call names one
//! ([`crate::call::CallPolicy::run`]), and what the call layer records of it (the process's metrics, the
//! calls file the IAM policies are checked against, the billed-request counter) is keyed by it, not by a
//! string someone spells at the call site.
//!
//! [`Billed`] is what the services bill: a call of an operation on a standard or a FIFO queue (SQS prices
//! them apart) and the further 64 KiB chunks of an SQS payload. Its [`Billed::name`] is the key a job's
//! request counts travel under (`sqs.ReceiveMessage`, `sqs.fifo.ReceiveMessage`,
//! `sqs.Extra64KiBChunks`): the names the domain's price table reads.

use std::fmt;

use crate::error::Service;

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

impl Service {
    /// The service as a metric label and a calls-file prefix: `sqs`, `s3`, `amqp`.
    pub const fn key(self) -> &'static str {
        match self {
            Service::Sqs => "sqs",
            Service::S3 => "s3",
            Service::RabbitMq => "amqp",
        }
    }
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

    /// The key a job's request counts carry it under, which the price table reads:
    /// `sqs.ReceiveMessage`, `sqs.fifo.ReceiveMessage`, `s3.GetObject`, `sqs.Extra64KiBChunks`,
    /// `sqs.fifo.Extra64KiBChunks`.
    pub fn name(self) -> String {
        let fifo = |fifo: bool| if fifo { "fifo." } else { "" };
        match self {
            Billed::Call { op, fifo: f } => format!("{}.{}{}", op.service().key(), fifo(f), op.name()),
            Billed::Extra64KiB { fifo: f } => format!("sqs.{}Extra64KiBChunks", fifo(f)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_apis_and_billed_keys_carry_the_fifo_apart() {
        assert_eq!(Op::SqsReceiveMessage.to_string(), "sqs.ReceiveMessage");
        assert_eq!(Op::AmqpPublish.to_string(), "amqp.basic.publish");
        assert_eq!(Billed::Call { op: Op::SqsDeleteMessageBatch, fifo: true }.name(), "sqs.fifo.DeleteMessageBatch");
        assert_eq!(Billed::call(Op::S3PutObject).name(), "s3.PutObject");
        assert_eq!(Billed::Extra64KiB { fifo: false }.name(), "sqs.Extra64KiBChunks");
        let mut names: Vec<String> = Op::ALL.iter().map(Op::to_string).collect();
        names.dedup();
        assert_eq!(names.len(), Op::ALL.len(), "two operations with one name");
        assert_eq!((sqs_extra_chunks(0), sqs_extra_chunks(1), sqs_extra_chunks(65_536), sqs_extra_chunks(65_537), sqs_extra_chunks(262_144)), (0, 0, 0, 1, 3));
    }

    /// The price table (the domain's) prices every billed key the clients count, each at its own
    /// service's price, a FIFO queue's at SQS's FIFO price: a key renamed on one side only fails here.
    #[test]
    fn every_billed_key_is_one_the_price_table_reads() {
        use fleet_domain::prices::{Billed as Priced, SQS_EXTRA_64K, SQS_FIFO_EXTRA_64K};
        use fleet_domain::requests::RequestCounts;
        assert_eq!(Billed::Extra64KiB { fifo: false }.name(), SQS_EXTRA_64K);
        assert_eq!(Billed::Extra64KiB { fifo: true }.name(), SQS_FIFO_EXTRA_64K);
        for op in Op::ALL.iter().filter(|op| op.service() != Service::RabbitMq) {
            for fifo in [false, true] {
                if fifo && op.service() != Service::Sqs {
                    continue;
                }
                let mut c = RequestCounts::default();
                c.add(&Billed::Call { op: *op, fifo }.name(), 1_000);
                let b = Priced::of(&c);
                let got = (b.sqs, b.sqs_fifo, b.s3_put + b.s3_get);
                match (op.service(), fifo) {
                    (Service::Sqs, false) => assert_eq!(got, (1_000, 0, 0), "{op}"),
                    (Service::Sqs, true) => assert_eq!(got, (0, 1_000, 0), "{op} fifo"),
                    _ if *op == Op::S3DeleteObject => assert_eq!(got, (0, 0, 0), "{op} is free"),
                    _ => assert_eq!(got, (0, 0, 1_000), "{op}"),
                }
            }
        }
    }
}
