//! PEM files that flags name (a broker's CA, the KEDA endpoint's certificate and key): read when the
//! flags are parsed (a clap value parser), so a missing, unreadable or non-PEM file stops a service
//! before it opens anything, with the file named. Debug shows the path only: a key may be in it.

use std::sync::Arc;

/// A file of PEM blocks, read once.
#[derive(Clone)]
pub struct PemFile {
    path: String,
    pem: Arc<str>,
}

impl PemFile {
    /// Reads `path`; it must hold at least one PEM block (`-----BEGIN ...-----`).
    pub fn read(path: &str) -> Result<PemFile, String> {
        let pem = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        let f = PemFile { path: path.to_string(), pem: pem.into() };
        if !f.pem.lines().any(|l| l.starts_with("-----BEGIN ")) {
            return Err(format!("{path}: no PEM block in it"));
        }
        Ok(f)
    }

    /// Whether a block of this kind is in it (`CERTIFICATE`, `PRIVATE KEY`, ...).
    pub fn holds(&self, label: &str) -> bool {
        self.pem.lines().any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{label}-----")))
    }

    /// The file it was read from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its text.
    pub fn pem(&self) -> &str {
        &self.pem
    }
}

impl std::fmt::Debug for PemFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PemFile({})", self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pem_and_names_the_file_when_it_cannot() {
        let dir = std::env::temp_dir().join(format!("fleet-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("key.pem");
        std::fs::write(&key, "-----BEGIN PRIVATE KEY-----\nSECRET\n-----END PRIVATE KEY-----\n").unwrap();
        let f = PemFile::read(key.to_str().unwrap()).unwrap();
        assert!(f.holds("PRIVATE KEY") && !f.holds("CERTIFICATE"));
        assert!(!format!("{f:?}").contains("SECRET"));
        let plain = dir.join("plain.txt");
        std::fs::write(&plain, "text").unwrap();
        assert_eq!(PemFile::read(plain.to_str().unwrap()).unwrap_err(), format!("{}: no PEM block in it", plain.display()));
        assert!(PemFile::read("/nonexistent/x.pem").unwrap_err().starts_with("/nonexistent/x.pem: "));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
