//! What a job's requests cost: a table of list prices (AWS's, us-east-1, as published in 2026; an
//! operator overrides any of them with `--prices`/`FLEET_PRICES`) and the cost of a job's
//! [`RequestCounts`] at them, as its report shows it. The scaling agent's simulated day prices its
//! requests with the same table.
//!
//! SQS bills every 64 KiB of a call's payload as one request: the clients count the chunks beyond
//! the first ([`Billed::Extra64KiB`]), so that a job's SQS figure is what SQS bills. A FIFO queue's
//! calls are counted apart (`Billed::Call { fifo: true, .. }`) and priced at SQS's FIFO price. S3 bills PUT, COPY,
//! POST and LIST at one price, GET, HEAD and the rest at another; DELETE is free.

use std::fmt;
use std::str::FromStr;

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::requests::{Billed, Op, RequestCounts, Service};

/// List prices of requests, USD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prices {
    /// SQS standard queue, per million requests (`sqs`).
    pub sqs_per_million: Decimal,
    /// SQS FIFO queue, per million requests (`sqs_fifo`; absent from tables written before it was).
    #[serde(default = "fifo_list_price")]
    pub sqs_fifo_per_million: Decimal,
    /// S3 Standard PUT, COPY, POST and LIST, per thousand requests (`s3_put`).
    pub s3_put_per_thousand: Decimal,
    /// S3 Standard GET, HEAD and every other request but DELETE, per thousand requests (`s3_get`).
    pub s3_get_per_thousand: Decimal,
}

impl Default for Prices {
    /// AWS's list prices, us-east-1: SQS standard $0.40 and FIFO $0.50 per million requests (after
    /// the free tier), S3 Standard $0.005 per 1,000 PUT-class and $0.0004 per 1,000 GET-class requests.
    fn default() -> Self {
        Prices {
            sqs_per_million: Decimal::new(40, 2),
            sqs_fifo_per_million: fifo_list_price(),
            s3_put_per_thousand: Decimal::new(5, 3),
            s3_get_per_thousand: Decimal::new(4, 4),
        }
    }
}

fn fifo_list_price() -> Decimal {
    Decimal::new(50, 2)
}

/// The keys `Prices::from_str` takes.
const KEYS: &str = "sqs and sqs_fifo (USD per million requests), s3_put and s3_get (USD per thousand requests)";

impl FromStr for Prices {
    type Err = String;

    /// `key=value` pairs, comma-separated, each overriding one list price: `sqs=0.50,s3_put=0.0054`.
    fn from_str(s: &str) -> Result<Prices, String> {
        let mut p = Prices::default();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| format!("'{pair}' is not key=value (keys: {KEYS})"))?;
            let value: Decimal = value.trim().parse().map_err(|_| format!("{}: '{}' is not a price in USD", key.trim(), value.trim()))?;
            if value.is_sign_negative() {
                return Err(format!("{}: a price cannot be negative ({value})", key.trim()));
            }
            match key.trim() {
                "sqs" => p.sqs_per_million = value,
                "sqs_fifo" => p.sqs_fifo_per_million = value,
                "s3_put" => p.s3_put_per_thousand = value,
                "s3_get" => p.s3_get_per_thousand = value,
                other => return Err(format!("'{other}' is not a price this table has (keys: {KEYS})")),
            }
        }
        Ok(p)
    }
}

impl fmt::Display for Prices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sqs={},sqs_fifo={},s3_put={},s3_get={}", self.sqs_per_million, self.sqs_fifo_per_million, self.s3_put_per_thousand, self.s3_get_per_thousand)
    }
}

/// What S3 charges an operation as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum S3Class {
    Put,
    Get,
    Free,
}

/// An S3 operation's price class: PUT (and COPY, POST) and LIST at one price, DELETE free, the rest
/// (GET, HEAD, ...) at the other.
pub fn s3_class(op: Op) -> S3Class {
    match op {
        Op::S3PutObject | Op::S3ListObjectsV2 => S3Class::Put,
        Op::S3DeleteObject => S3Class::Free,
        _ => S3Class::Get,
    }
}

/// Billed requests of a job, by price class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByClass {
    /// SQS requests to standard queues as billed (calls plus their payloads' further 64 KiB chunks).
    pub sqs: u64,
    /// The same to FIFO queues.
    pub sqs_fifo: u64,
    pub s3_put: u64,
    pub s3_get: u64,
}

impl ByClass {
    /// From a job's counts.
    pub fn of(counts: &RequestCounts) -> ByClass {
        let mut b = ByClass::default();
        for (what, n) in counts.iter() {
            let class = match (what.service(), what) {
                (Service::Sqs, _) if what.fifo() => &mut b.sqs_fifo,
                (Service::Sqs, _) => &mut b.sqs,
                (Service::S3, Billed::Call { op, .. }) => match s3_class(op) {
                    S3Class::Put => &mut b.s3_put,
                    S3Class::Get => &mut b.s3_get,
                    S3Class::Free => continue,
                },
                _ => continue,
            };
            *class = class.saturating_add(n);
        }
        b
    }
}

/// A job's requests at a price table, USD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost {
    pub sqs: Decimal,
    pub s3: Decimal,
}

impl Cost {
    pub fn total(&self) -> Decimal {
        self.sqs + self.s3
    }

    /// The cost per million of `transactions` (none for none).
    pub fn per_million(&self, transactions: u64) -> Option<Decimal> {
        (transactions > 0).then(|| self.total() * Decimal::from(1_000_000u64) / Decimal::from(transactions))
    }
}

impl Prices {
    /// What `billed` costs at these prices.
    pub fn cost(&self, billed: ByClass) -> Cost {
        let million = Decimal::from(1_000_000u64);
        let thousand = Decimal::from(1_000u64);
        Cost {
            sqs: (Decimal::from(billed.sqs) * self.sqs_per_million + Decimal::from(billed.sqs_fifo) * self.sqs_fifo_per_million) / million,
            s3: Decimal::from(billed.s3_put) * self.s3_put_per_thousand / thousand + Decimal::from(billed.s3_get) * self.s3_get_per_thousand / thousand,
        }
    }

    /// The same as `f64`s, for the simulation (USD per request: SQS, S3 PUT, S3 GET).
    pub fn per_request(&self) -> (f64, f64, f64) {
        use rust_decimal::prelude::ToPrimitive;
        let f = |d: Decimal| d.to_f64().unwrap_or(0.0);
        (f(self.sqs_per_million) / 1e6, f(self.s3_put_per_thousand) / 1e3, f(self.s3_get_per_thousand) / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_prices_overrides_and_errors_that_say_what() {
        let p: Prices = "".parse().unwrap();
        assert_eq!(p, Prices::default());
        assert_eq!(p.to_string(), "sqs=0.40,sqs_fifo=0.50,s3_put=0.005,s3_get=0.0004");
        let p: Prices = "sqs=0.50, s3_get=0.00044".parse().unwrap();
        assert_eq!(
            (p.sqs_per_million.to_string(), p.s3_put_per_thousand.to_string(), p.s3_get_per_thousand.to_string()),
            ("0.50".into(), "0.005".into(), "0.00044".into())
        );
        assert_eq!(p.to_string().parse::<Prices>().unwrap(), p, "Display reads back");
        let e = "sqs=cheap".parse::<Prices>().unwrap_err();
        assert!(e.contains("sqs") && e.contains("'cheap'"), "{e}");
        let e = "lambda=0.2".parse::<Prices>().unwrap_err();
        assert!(e.contains("'lambda'") && e.contains("keys:"), "{e}");
        assert!("sqs".parse::<Prices>().unwrap_err().contains("key=value"));
        assert!("s3_put=-1".parse::<Prices>().unwrap_err().contains("negative"));
    }

    #[test]
    fn a_jobs_requests_are_billed_by_class_with_sqs_payload_chunks() {
        let mut c = RequestCounts::default();
        c.add(Billed::call(Op::SqsSendMessageBatch), 100);
        c.add(Billed::call(Op::SqsReceiveMessage), 400);
        c.add(Billed::Extra64KiB { fifo: false }, 500);
        c.add(Billed::call(Op::S3PutObject), 150);
        c.add(Billed::call(Op::S3ListObjectsV2), 50);
        c.add(Billed::call(Op::S3GetObject), 1_000);
        c.add(Billed::call(Op::S3HeadObject), 250);
        c.add(Billed::call(Op::S3DeleteObject), 99);
        let b = ByClass::of(&c);
        assert_eq!(b, ByClass { sqs: 1_000, sqs_fifo: 0, s3_put: 200, s3_get: 1_250 });
        let cost = Prices::default().cost(b);
        // 1,000 x 0.40/M + 200 x 0.005/k + 1,250 x 0.0004/k
        assert_eq!(cost.sqs, Decimal::new(4, 4));
        assert_eq!(cost.s3, Decimal::new(15, 4));
        assert_eq!(cost.total(), Decimal::new(19, 4));
        assert_eq!(cost.per_million(500_000), Some(Decimal::new(38, 4)));
        assert_eq!(cost.per_million(0), None);
        // A FIFO queue's calls at the FIFO price: 300 x 0.50/M more.
        c.add(Billed::Call { op: Op::SqsReceiveMessage, fifo: true }, 200);
        c.add(Billed::Extra64KiB { fifo: true }, 100);
        let b = ByClass::of(&c);
        assert_eq!((b.sqs, b.sqs_fifo), (1_000, 300));
        assert_eq!(Prices::default().cost(b).sqs, Decimal::new(4, 4) + Decimal::new(15, 5));
        let old: Prices = serde_json::from_str(r#"{"sqs_per_million":"0.40","s3_put_per_thousand":"0.005","s3_get_per_thousand":"0.0004"}"#).unwrap();
        assert_eq!(old, Prices::default(), "a table from before the FIFO price reads with the list price");
    }

    /// The price table prices every billed request the clients count, each at its own service's
    /// price, a FIFO queue's at SQS's FIFO price, DELETE free.
    #[test]
    fn every_billed_request_is_priced_at_its_service() {
        for what in Billed::all().filter(|b| b.service() != Service::RabbitMq) {
            let c: RequestCounts = [(what, 1_000)].into_iter().collect();
            let b = ByClass::of(&c);
            let got = (b.sqs, b.sqs_fifo, b.s3_put + b.s3_get);
            match (what.service(), what.fifo()) {
                (Service::Sqs, false) => assert_eq!(got, (1_000, 0, 0), "{what}"),
                (Service::Sqs, true) => assert_eq!(got, (0, 1_000, 0), "{what} fifo"),
                _ if what == Billed::call(Op::S3DeleteObject) => assert_eq!(got, (0, 0, 0), "{what} is free"),
                _ => assert_eq!(got, (0, 0, 1_000), "{what}"),
            }
        }
    }
}
