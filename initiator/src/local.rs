//! `initiator local`: bills files in this one process with no queues or storage: a dry run for users
//! and the baseline the benchmark compares the fleet against (parse, validate, bill).

use std::path::PathBuf;

use fleet_domain::billing::{Tariff, Totals};
use fleet_domain::input::Validator;
use fleet_domain::model::{now_rfc3339, Manifest, WIRE_VERSION};
use fleet_domain::report::{self, Report};
use fleet_domain::requests::RequestCounts;

use crate::CliError;

/// Reads, validates and bills `files` (`-`: standard input); the report has job id `local`.
pub fn bill(files: &[PathBuf], tariff: &Tariff) -> Result<Report, CliError> {
    let inputs = crate::submit::open_inputs(files, &crate::submit::Stdin::default())?;
    let calc = tariff.calculator();
    let mut v = Validator::new();
    let mut rejected = Vec::new();
    let mut totals = Totals::new();
    for f in &inputs {
        v.read(f, |t| totals.add_txn(t, &calc), |r| rejected.push(r), |_| {}).map_err(|e| CliError::Input(e.to_string()))?;
    }
    let manifest = Manifest {
        chunk_lines: Vec::new(),
        completes: None,
        v: WIRE_VERSION,
        job_id: "local".into(),
        created_at: now_rfc3339(),
        files: inputs.iter().map(|f| f.name.clone()).collect(),
        submitted: v.counts.submitted,
        accepted: v.counts.accepted,
        rejected,
        total_chunks: 0,
        chunk_transactions: Vec::new(),
        tariff: tariff.clone(),
        requests: RequestCounts::default(),
        partition: 0,
    };
    Ok(report::build(&manifest, &totals, Vec::new(), &RequestCounts::default()))
}
