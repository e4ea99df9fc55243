//! Where things live in the bucket: chunk blobs, manifests and large results under `jobs/{job}/`
//! (written by submitters and processors), each job's checkpoint under `checkpoints/{job}/` (written
//! by controllers only), finished reports under `warehouse/{job}/`.

use crate::error::{Error, Result};

pub const JOBS_PREFIX: &str = "jobs/";
pub const WAREHOUSE_PREFIX: &str = "warehouse/";
/// One marker per job a controller has started and not finished (`open/{job}`): what a restarted
/// controller sweeps for jobs that never sealed.
pub const OPEN_PREFIX: &str = "open/";

pub fn chunk_key(job: &str, chunk: u32) -> String {
    format!("{JOBS_PREFIX}{job}/chunks/{chunk:06}.csv.zst")
}

pub fn result_key(job: &str, chunk: u32) -> String {
    format!("{JOBS_PREFIX}{job}/results/{chunk:06}.json.zst")
}

/// The largest manifest a reader accepts (a CSV with millions of rejected rows would make one of
/// gigabytes): a larger one is read as corrupt, and its job quarantined.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

/// Claims of billed transactions (see `controller_core::claims`): written by controllers only.
pub const CLAIMS_PREFIX: &str = "claims/";

/// Segment `seg` of the claims of day `day` (yyyymmdd) in shard `shard`.
pub fn claims_key(day: u32, shard: u32, seg: u32) -> String {
    format!("{}{seg:06}.bin", claims_chain_prefix(day, shard))
}

/// Where the segments of one (day, shard) chain are.
pub fn claims_chain_prefix(day: u32, shard: u32) -> String {
    format!("{CLAIMS_PREFIX}{}/{shard:02x}/", crate::claim_rows::day_text(day))
}

/// The segment number of a key under [`claims_chain_prefix`].
pub fn claims_segment_of(key: &str) -> Option<u32> {
    key.rsplit('/').next()?.strip_suffix(".bin")?.parse().ok()
}

/// The tariff a job is billed with, stored by its initiator before its first work item: what a job
/// whose submission never wrote its manifest was billed with (read only for that).
pub fn tariff_key(job: &str) -> String {
    format!("{JOBS_PREFIX}{job}/tariff.json")
}

/// The failed chunks of a finished job whose blobs are kept for a retry ([`crate::model::Kept`]).
pub fn kept_key(job: &str) -> String {
    format!("{JOBS_PREFIX}{job}/kept.json")
}

pub fn manifest_key(job: &str) -> String {
    format!("{JOBS_PREFIX}{job}/manifest.json")
}

/// Controllers' per-job state: a prefix no other role may write (see docs/security.md).
pub const CHECKPOINTS_PREFIX: &str = "checkpoints/";

pub fn checkpoint_key(job: &str) -> String {
    format!("{CHECKPOINTS_PREFIX}{job}/checkpoint.json.zst")
}

/// Where releases before `checkpoints/` kept a job's checkpoint, beside its chunk blobs: read when
/// the job has none at [`checkpoint_key`] (a job begun before the upgrade), never written.
pub fn legacy_checkpoint_key(job: &str) -> String {
    format!("{JOBS_PREFIX}{job}/checkpoint.json.zst")
}

/// The keys a job's checkpoint may be at, where it is looked for first.
pub fn checkpoint_keys(job: &str) -> [String; 2] {
    [checkpoint_key(job), legacy_checkpoint_key(job)]
}

/// Where the checkpoint of a quarantined job that could not be read is kept, as it was.
pub fn quarantined_checkpoint_key(job: &str) -> String {
    format!("{CHECKPOINTS_PREFIX}{job}/quarantined.json.zst")
}

/// Where the parts of a job's checkpoint live (large jobs): see `model::CheckpointPart`.
pub fn checkpoint_parts_prefix(job: &str) -> String {
    format!("{CHECKPOINTS_PREFIX}{job}/parts/")
}

/// The job whose checkpoint part `key` is, and where its name begins (`None`: not a part's key of
/// this release's layout).
pub fn checkpoint_part_of(key: &str) -> Option<(&str, usize)> {
    let (job, _) = key.strip_prefix(CHECKPOINTS_PREFIX)?.split_once("/parts/")?;
    Some((job, CHECKPOINTS_PREFIX.len() + job.len() + "/parts/".len()))
}

/// Where releases before `checkpoints/` kept the parts (a legacy checkpoint names them by key).
pub fn legacy_checkpoint_parts_prefix(job: &str) -> String {
    format!("{JOBS_PREFIX}{job}/checkpoint/")
}

pub fn report_key(job: &str) -> String {
    format!("{WAREHOUSE_PREFIX}{job}/report.json")
}

pub fn accounts_key(job: &str) -> String {
    format!("{WAREHOUSE_PREFIX}{job}/accounts.csv")
}

/// Which controller owns each partition of the results queue, and which controllers are alive (see
/// the controller's `partitions`): one document, changed only by conditional writes.
pub const PARTITIONS_KEY: &str = "partitions/owners.json";

/// The results partition a job's messages travel on, out of `count`: a hash of its id, so that jobs
/// spread evenly; chosen once, when the job is submitted, and carried by its work items and manifest
/// (a job keeps its partition when the count changes).
pub fn partition_of(job: &str, count: u16) -> u16 {
    (xxhash_rust::xxh3::xxh3_64(job.as_bytes()) % u64::from(count.max(1))) as u16
}

/// Which controller owns a job now, until when (seed 003's leases, per job).
pub fn lease_key(job: &str) -> String {
    format!("leases/{job}.json")
}

pub fn open_key(job: &str) -> String {
    format!("{OPEN_PREFIX}{job}")
}

/// A new job id: time-ordered (UUID v7), safe in keys.
pub fn new_job_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// Job ids come from users and from queue messages: only `[A-Za-z0-9_-]{1,64}` may become part of a key.
pub fn check_job_id(job: &str) -> Result<()> {
    if !job.is_empty() && job.len() <= 64 && job.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        Ok(())
    } else {
        Err(Error::Corrupt(format!("invalid job id {job:?}: expected 1-64 of [A-Za-z0-9_-]")))
    }
}

/// A chunk key must be the one this job and chunk would have (the queue is untrusted).
pub fn check_chunk_key(job: &str, chunk: u32, key: &str) -> Result<()> {
    check_job_id(job)?;
    if key == chunk_key(job, chunk) {
        Ok(())
    } else {
        Err(Error::Corrupt(format!("blob key {key:?} is not the key of job {job} chunk {chunk}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_checks() {
        let j = new_job_id();
        check_job_id(&j).unwrap();
        assert!(check_job_id("../etc").is_err());
        assert!(check_job_id("").is_err());
        assert_eq!(chunk_key("j1", 7), "jobs/j1/chunks/000007.csv.zst");
        check_chunk_key("j1", 7, "jobs/j1/chunks/000007.csv.zst").unwrap();
        assert!(check_chunk_key("j1", 7, "jobs/j2/chunks/000007.csv.zst").is_err());
        let part = format!("{}p1.csv.zst", checkpoint_parts_prefix("j1"));
        assert_eq!(checkpoint_part_of(&part), Some(("j1", part.len() - "p1.csv.zst".len())));
        assert_eq!(checkpoint_part_of(&checkpoint_key("j1")), None);
    }
}
