//! `initiator retry JOB`: a finished job's failed chunks billed again, as a new job that completes it.
//!
//! A job's controller names its failed chunks in `jobs/{job}/kept.json` before its report, and its
//! purge leaves their blobs (and the job's tariff) in place: the rows a `partial` job could not bill
//! are still in the bucket, for 30 days (the lifecycle rule of `jobs/`). A retry reads that list, the
//! job's manifest (its tariff, and where each chunk's rows came from) and each kept chunk, writes the
//! chunks' rows to local files and submits them as a new job whose manifest names the job it
//! completes (`completes`: its report, summary and jobs-table row say so), billed with the first
//! job's tariff. Exactly once whatever is run twice: a row a retry bills is claimed (docs/claims.md),
//! so a second retry, or the original files submitted again, bills it as a duplicate of the first.
//! The kept blobs are not deleted by a retry (the submitting role deletes nothing): they go with the
//! lifecycle rule, or at once with `retry JOB --give-up` under the operator's identity, which also
//! says how many transactions are given up unbilled.

use std::path::{Path, PathBuf};

use fleet_domain::billing::Tariff;
use fleet_domain::layout::{chunk_key, kept_key, manifest_key, tariff_key, MAX_MANIFEST_BYTES};
use fleet_domain::model::{Kept, Manifest};
use fleet_io::blob::BlobStore;

use crate::CliError;

/// The most a kept chunk may inflate to (a chunk is at most `--chunk-bytes`, 4 MiB by default).
const MAX_CHUNK_BYTES: u64 = 256 << 20;

/// A retry made ready: the kept chunks as local files, and what they are billed with.
#[derive(Debug)]
pub struct Prepared {
    /// The chunks written to `files`, in order.
    pub chunks: Vec<u32>,
    pub files: Vec<PathBuf>,
    pub tariff: Tariff,
    /// Kept chunks that could not be read: each with where its rows came from and why.
    pub unreadable: Vec<String>,
}

/// What the kept list of `job` says, or why there is none.
pub async fn kept(store: &dyn BlobStore, job: &str) -> Result<Kept, CliError> {
    crate::follow::checked(job)?;
    let Some(b) = store.get(&kept_key(job)).await? else {
        return Err(CliError::Input(format!(
            "job {job} keeps no failed chunks: it completed, was quarantined, its chunks were given up, or they expired (30 days); \
             to bill rows of it that were never billed, submit its files again (rows already billed are not billed again)"
        )));
    };
    let k: Kept = serde_json::from_slice(&b).map_err(|e| CliError::Input(format!("{}: not a kept list: {e}", kept_key(job))))?;
    if k.job_id != job {
        return Err(CliError::Input(format!("{}: names job {}, not {job}", kept_key(job), k.job_id)));
    }
    Ok(k)
}

/// Reads job `job`'s kept chunks into `dir` (one CSV file each, `{job}-chunk-NNNNNN.csv`).
pub async fn prepare(store: &dyn BlobStore, job: &str, dir: &Path) -> Result<Prepared, CliError> {
    let k = kept(store, job).await?;
    let manifest: Option<Manifest> = match store.get_capped(&manifest_key(job), MAX_MANIFEST_BYTES).await? {
        Some(b) => Some(serde_json::from_slice(&b).map_err(fleet_io::Error::from)?),
        None => None,
    };
    // The tariff the job was billed with: its manifest's, else the one its initiator stored first.
    let tariff = match &manifest {
        Some(m) => m.tariff.clone(),
        None => match store.get(&tariff_key(job)).await? {
            Some(b) => serde_json::from_slice(&b).map_err(fleet_io::Error::from)?,
            None => return Err(CliError::Input(format!("job {job}: neither its manifest nor its tariff is there: the tariff its rows are billed with is unknown"))),
        },
    };
    let mut p = Prepared { chunks: Vec::new(), files: Vec::new(), tariff, unreadable: Vec::new() };
    for &c in &k.chunks {
        let from = manifest.as_ref().map(|m| m.chunk_source(c)).unwrap_or_default();
        let from = if from.is_empty() {
            String::new()
        } else {
            format!(" ({})", from.iter().map(|l| format!("{} lines {}-{}", l.file, l.first, l.last)).collect::<Vec<_>>().join(", "))
        };
        let raw = match store.get(&chunk_key(job, c)).await? {
            None => Err("its blob is gone (expired or given up)".to_string()),
            Some(b) => fleet_domain::codec::decompress_capped(&b, MAX_CHUNK_BYTES).map_err(|e| format!("its blob cannot be read: {e}")),
        };
        // As many rows as the job recorded for the chunk (a blob put back by hand must be the chunk).
        let raw = raw.and_then(|raw| {
            let rows = raw.split(|&b| b == b'\n').skip(1).filter(|l| !l.is_empty()).count() as u64;
            match manifest.as_ref().and_then(|m| m.chunk_transactions.get(c as usize)) {
                Some(&want) if want != rows => Err(format!("its blob holds {rows} rows, the job recorded {want} for it")),
                _ => Ok(raw),
            }
        });
        match raw {
            Ok(raw) => {
                let path = dir.join(format!("{job}-chunk-{c:06}.csv"));
                std::fs::write(&path, &raw).map_err(|e| CliError::Input(format!("{}: {e}", path.display())))?;
                p.chunks.push(c);
                p.files.push(path);
            }
            Err(why) => p.unreadable.push(format!("chunk {c}{from}: {why}: submit those lines again")),
        }
    }
    Ok(p)
}

/// Deletes job `job`'s kept chunks and its kept list (and its tariff, which the purge left with
/// them): the operator gives their rows up. Returns the chunks given up.
pub async fn give_up(store: &dyn BlobStore, job: &str) -> Result<Vec<u32>, CliError> {
    let k = kept(store, job).await?;
    for &c in &k.chunks {
        store.delete(&chunk_key(job, c)).await?;
    }
    // The list last: a give-up cut short is run again from it.
    store.delete(&tariff_key(job)).await?;
    store.delete(&kept_key(job)).await?;
    Ok(k.chunks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use fleet_io::blob::memory::MemoryStore;

    #[tokio::test]
    async fn kept_chunks_come_back_as_files_with_the_jobs_tariff_and_a_missing_one_is_named() {
        let store = MemoryStore::new();
        let job = "j-1";
        let tariff: Tariff = serde_json::from_str(r#"{"fixed_fee":"0.10","percent":"1"}"#).unwrap();
        let mut w = fleet_domain::codec::ChunkWriter::new();
        let t = fleet_domain::validate::validate_row(Some(b"t1"), Some(b"A"), Some(b"12.50"), Some(b"EUR"), Some(b"2026-12-01T10:00:00Z")).unwrap();
        w.push_from(&t, 0, 7);
        let enc = fleet_domain::codec::encode_chunk(w);
        store.put(&chunk_key(job, 2), Bytes::from(enc.bytes.clone()), "application/zstd").await.unwrap();
        let kept = Kept { v: 1, job_id: job.into(), chunks: vec![2, 3] };
        store.put(&kept_key(job), Bytes::from(serde_json::to_vec(&kept).unwrap()), "application/json").await.unwrap();
        store.put(&tariff_key(job), Bytes::from(serde_json::to_vec(&tariff).unwrap()), "application/json").await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = prepare(store.as_ref(), job, dir.path()).await.unwrap();
        assert_eq!(p.chunks, [2]);
        assert_eq!(p.tariff, tariff, "the job's own tariff, from its initiator's copy without a manifest");
        assert_eq!(std::fs::read_to_string(&p.files[0]).unwrap(), "txn_id,account_id,amount,currency,timestamp\nt1,A,12.50,EUR,2026-12-01T10:00:00Z\n");
        assert_eq!(p.unreadable.len(), 1);
        assert!(p.unreadable[0].starts_with("chunk 3: its blob is gone"), "{:?}", p.unreadable);
        assert_eq!(give_up(store.as_ref(), job).await.unwrap(), [2, 3]);
        assert!(store.get(&chunk_key(job, 2)).await.unwrap().is_none());
        let again = prepare(store.as_ref(), job, dir.path()).await.unwrap_err().to_string();
        assert!(again.contains("keeps no failed chunks"), "{again}");
    }
}
