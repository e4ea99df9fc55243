//! The domain's error: data that failed an integrity or format check (checksum, size cap, schema,
//! version). Such data can never become valid by trying again, so this error is never retryable; the
//! I/O layer turns it into its own `Corrupt` variant.

/// Result alias for the domain.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Data that failed an integrity or format check.
    #[error("corrupt data: {0}")]
    Corrupt(String),
}

impl Error {
    /// Never: corrupt data stays corrupt (kept for callers that ask every error the same question).
    pub fn is_retryable(&self) -> bool {
        false
    }

    pub(crate) fn corrupt(msg: impl Into<String>) -> Self {
        Error::Corrupt(msg.into())
    }
}

/// What failed the check, without the "corrupt data" prefix: a layer with a `Corrupt` of its own takes
/// it as is (`fleet_io::Error::corrupt`).
impl From<Error> for String {
    fn from(e: Error) -> String {
        let Error::Corrupt(detail) = e;
        detail
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Corrupt(format!("invalid JSON: {e}"))
    }
}
