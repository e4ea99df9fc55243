//! The admin endpoint's bearer token: read from a file (`--admin-token-file`) or the environment
//! (`LISTENER_ADMIN_TOKEN`) when the flags are parsed, at least [`MIN_TOKEN_LEN`] characters, never
//! shown (its `Debug` is `AdminToken(***)`), compared in time independent of where it differs.

use std::fmt;
use std::path::Path;

/// Shortest token accepted.
pub const MIN_TOKEN_LEN: usize = 16;

/// A secret that authorizes `PUT /throttle` on the admin endpoint.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(***)")
    }
}

impl AdminToken {
    /// A token from its text (surrounding whitespace trimmed); too short or multi-line is an error
    /// that does not repeat it.
    pub fn parse(s: &str) -> Result<AdminToken, String> {
        let t = s.trim();
        if t.chars().count() < MIN_TOKEN_LEN {
            return Err(format!("the token must have at least {MIN_TOKEN_LEN} characters"));
        }
        if t.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("the token must not contain whitespace or control characters".into());
        }
        Ok(AdminToken(t.to_string()))
    }

    /// A token read from `path` (a mounted secret, say).
    pub fn from_file(path: &str) -> Result<AdminToken, String> {
        let text = std::fs::read_to_string(Path::new(path)).map_err(|e| format!("token file {path}: {e}"))?;
        AdminToken::parse(&text).map_err(|e| format!("token file {path}: {e}"))
    }

    /// Whether an `Authorization` header value is `Bearer <this token>`; the comparison takes the
    /// same time wherever the two differ.
    pub fn authorizes(&self, header: Option<&[u8]>) -> bool {
        let Some(given) = header.and_then(|h| h.strip_prefix(b"Bearer ")) else { return false };
        let want = self.0.as_bytes();
        let mut diff = u8::from(given.len() != want.len());
        for (i, w) in want.iter().enumerate() {
            diff |= w ^ given.get(i).copied().unwrap_or(0);
        }
        diff == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_long_hidden_and_matched_exactly() {
        assert!(AdminToken::parse("short").is_err());
        assert!(AdminToken::parse("sixteen chars ok").is_err(), "whitespace inside");
        let t = AdminToken::parse("  0123456789abcdef\n").unwrap();
        assert_eq!(format!("{t:?}"), "AdminToken(***)");
        assert!(t.authorizes(Some(b"Bearer 0123456789abcdef")));
        for bad in
            [&b"Bearer 0123456789abcde"[..], b"Bearer 0123456789abcdeg", b"Bearer 0123456789abcdefg", b"bearer 0123456789abcdef", b"0123456789abcdef", b""]
        {
            assert!(!t.authorizes(Some(bad)), "{}", String::from_utf8_lossy(bad));
        }
        assert!(!t.authorizes(None));
        let e = AdminToken::from_file("/nonexistent/token").unwrap_err();
        assert!(e.contains("/nonexistent/token"), "{e}");
        let dir = std::env::temp_dir().join(format!("admin-token-{}", std::process::id()));
        std::fs::write(&dir, "tooshort").unwrap();
        let e = AdminToken::from_file(dir.to_str().unwrap()).unwrap_err();
        assert!(!e.contains("tooshort") && e.contains("at least 16"), "{e}");
        let _ = std::fs::remove_file(dir);
    }
}
