//! The fleet's end-to-end tests, in one binary: the four services together on the LocalStack and
//! RabbitMQ that `deploy/test.sh` starts (in-process, or as the real binaries where a test kills or
//! signals a process), and on the in-memory backends. Container scenarios on the real Docker Engine are
//! the other binary, `compose`.

mod support;

mod broker_down;
mod cli;
mod faults;
mod flood;
mod iam;
mod keda;
mod leases;
mod localstack;
mod memory_pipeline;
mod no_switches;
mod once;
mod outage;
mod partitions;
mod pipeline;
mod readme_config;
mod reliability;
mod roles;
mod scaling;
mod shards;
mod status_page;
mod traces;
mod trigger;
mod wakeup;
mod warehouse;
