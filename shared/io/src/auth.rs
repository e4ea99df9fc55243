//! Authority by role: who may send what on the results queue. Every sender holds the key of its role
//! (a submitter, an operator, a processor, a controller) and signs each message it sends with it, an
//! HMAC-SHA256 over its role and its body, carried as the message attribute `fleet-auth`; the
//! controller holds every role's key (its keyring) and counts a message only when its signature
//! verifies and its role may send that kind of message (`controller::aggregate::item`). SQS keeps
//! message attributes through a dead-letter redrive, and the quarantine keeps them for a redrive, so a
//! message keeps its sender's word wherever it travels; a stray forwarded to its partition keeps it too.
//!
//! Why a MAC per role and not SQS's `SenderId` or separate queues: LocalStack fills `SenderId` with
//! one account for every caller, so a test could never tell a processor from a submitter, and IAM on
//! separate queues is enforced only on AWS; a signature is checked by the same code on both. The keys
//! are plain files (mounted from a secret store), one per role; a key's id is a hash of its role and
//! secret, so a keyring may hold several keys of a role at once: rotation adds the new key to the
//! controllers' keyring, moves the senders to it, then removes the old one, without downtime
//! (docs/security.md).
//!
//! A chunk's token ([`Key::chunk_token`]) binds a result to its work item: the submitter makes one per
//! chunk with its key, the work item carries it, the processor passes it on. It keeps a processor that
//! only knows a job's id from reporting its chunks; a processor that receives the work item (any
//! processor may) holds the token, so a rogue processor can still spoil the chunks it reads: that is
//! its role's to spoil.
//!
//! A key file is one line: the role, a space, and at least 32 bytes of secret in base64
//! (`processor 3q2+7w...`); lines starting with `#` are comments. Nothing here logs a secret: a key
//! shows as its role and id.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The message attribute that carries a signature.
pub const ATTRIBUTE: &str = "fleet-auth";

/// The message attribute that carries a chunk's token (see [`Key::chunk_token`]), on its work item
/// and on its result.
pub const CHUNK_ATTRIBUTE: &str = "fleet-chunk";

/// Least secret length, bytes.
const MIN_SECRET: usize = 32;

/// Who sent a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// `initiator submit`: work items, the seal, and an abandon of its own submission.
    Submitter,
    /// The operator's commands (`initiator abandon`, `dlq redrive`).
    Operator,
    /// A processor: chunk results and failure reports.
    Processor,
    /// A controller: dead-lettered work items forwarded to their job's partition.
    Controller,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Submitter, Role::Operator, Role::Processor, Role::Controller];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Submitter => "submitter",
            Role::Operator => "operator",
            Role::Processor => "processor",
            Role::Controller => "controller",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = Error;
    fn from_str(s: &str) -> Result<Role> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| Error::Config(format!("unknown role {s:?}: expected one of submitter, operator, processor, controller")))
    }
}

/// One role's key. Its `Debug` shows the role and id, never the secret.
#[derive(Clone)]
pub struct Key {
    role: Role,
    id: String,
    secret: Vec<u8>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({} {}, ***)", self.role, self.id)
    }
}

impl Key {
    /// A key of `role` with this secret (at least 32 bytes).
    pub fn new(role: Role, secret: Vec<u8>) -> Result<Key> {
        if secret.len() < MIN_SECRET {
            return Err(Error::Config(format!("a {role} key needs at least {MIN_SECRET} bytes of secret, it has {}", secret.len())));
        }
        // The role is part of the id: one secret given to two roles makes two keys, never one that
        // silently replaces the other in a keyring.
        let mut h = Sha256::new();
        h.update(role.as_str().as_bytes());
        h.update(b"\0");
        h.update(&secret);
        let id = hex(&h.finalize()[..8]);
        Ok(Key { role, id, secret })
    }

    /// A new random key of `role` (its file's line: [`Key::to_line`]).
    pub fn generate(role: Role) -> Key {
        let secret: Vec<u8> = (0..MIN_SECRET).map(|_| rand::random::<u8>()).collect();
        Key::new(role, secret).expect("long enough")
    }

    /// Reads a key file (`ROLE BASE64`; `#` comments), saying which file and line is wrong.
    pub fn from_file(path: &Path) -> Result<Key> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Config(format!("{}: cannot read the key: {e}", path.display())))?;
        Key::parse(&text).map_err(|e| Error::Config(format!("{}: {e}", path.display())))
    }

    /// Parses a key file's text.
    pub fn parse(text: &str) -> std::result::Result<Key, String> {
        let (n, line) = text
            .lines()
            .enumerate()
            .map(|(n, l)| (n + 1, l.trim()))
            .find(|(_, l)| !l.is_empty() && !l.starts_with('#'))
            .ok_or("no key in it (expected a line `ROLE BASE64-SECRET`)")?;
        let (role, secret) = line.split_once(char::is_whitespace).ok_or_else(|| format!("line {n}: expected `ROLE BASE64-SECRET`"))?;
        let role = Role::ALL
            .into_iter()
            .find(|r| r.as_str() == role)
            .ok_or_else(|| format!("line {n}: unknown role {role:?}: expected one of submitter, operator, processor, controller"))?;
        let secret = base64::engine::general_purpose::STANDARD.decode(secret.trim()).map_err(|e| format!("line {n}: the secret is not base64: {e}"))?;
        Key::new(role, secret).map_err(|e| format!("line {n}: {e}"))
    }

    /// The key file's line.
    pub fn to_line(&self) -> String {
        format!("{} {}\n", self.role, base64::engine::general_purpose::STANDARD.encode(&self.secret))
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// Its id: the first 8 bytes of its secret's SHA-256, hex.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The MAC of a message `body` signed as this key's role (before it is finalised or checked).
    fn message_mac(&self, body: &str) -> Hmac<Sha256> {
        hmac(&self.secret, &[b"fleet-auth v1\0", self.role.as_str().as_bytes(), b"\0", body.as_bytes()])
    }

    /// A submitter's token for chunk `chunk` of `job` (the work item's [`CHUNK_ATTRIBUTE`]): the
    /// processor handed the work item passes it on with the chunk's result, and the controller counts a
    /// result only with it. So a processor can report only chunks whose work items it has read: one that
    /// only knows a job's id cannot bill its chunks.
    pub fn chunk_token(&self, job: &str, chunk: u32) -> String {
        let m = hmac(&self.secret, &[b"fleet-chunk v1\0", job.as_bytes(), b"\0", chunk.to_string().as_bytes()]);
        format!("{}.{}", self.id, base64::engine::general_purpose::STANDARD_NO_PAD.encode(m.finalize().into_bytes()))
    }

    /// The signature of `body` as this key's role: the value of [`ATTRIBUTE`]
    /// (`v1.ROLE.KEY-ID.MAC`, the MAC in base64 without padding).
    pub fn sign(&self, body: &str) -> String {
        format!("v1.{}.{}.{}", self.role, self.id, base64::engine::general_purpose::STANDARD_NO_PAD.encode(self.message_mac(body).finalize().into_bytes()))
    }
}

/// Why a message's signature does not count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("it is not signed (no {ATTRIBUTE} attribute)")]
    Unsigned,
    #[error("its signature cannot be read")]
    Malformed,
    #[error("it is signed with a key this controller does not hold ({role} key {id})")]
    UnknownKey { role: String, id: String },
    #[error("its signature does not match its body (a {0} key)")]
    Mismatch(Role),
    #[error("it carries no valid token of its chunk (only the processor handed the chunk's work item has one)")]
    ChunkToken,
}

/// The keys a receiver checks signatures with: every role's, several per role while a key is rotated.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    keys: BTreeMap<String, Key>,
    /// Each role's first key given (its file's name sorts first): the one its holder signs with.
    first: BTreeMap<Role, Key>,
}

impl Keyring {
    pub fn new(keys: impl IntoIterator<Item = Key>) -> Keyring {
        let mut ring = Keyring::default();
        for k in keys {
            ring.first.entry(k.role).or_insert_with(|| k.clone());
            ring.keys.insert(k.id.clone(), k);
        }
        ring
    }

    /// The key a holder of the keyring signs with as `role`: the first one given (from a directory,
    /// the file whose name sorts first). A rotation names the new file after the old one: every
    /// controller keeps signing with the old key, which all of them hold, until the old file is
    /// removed everywhere, and only then signs with the new one, which by then all of them hold.
    pub fn signing_key(&self, role: Role) -> Option<&Key> {
        self.first.get(&role)
    }

    /// Every key file (`*.key`) in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Keyring> {
        let entries = std::fs::read_dir(dir).map_err(|e| Error::Config(format!("{}: cannot read the keyring: {e}", dir.display())))?;
        let mut files: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "key")).collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::Config(format!("{}: no key files (*.key) in the keyring", dir.display())));
        }
        Ok(Keyring::new(files.iter().map(|p| Key::from_file(p)).collect::<Result<Vec<_>>>()?))
    }

    /// The roles it holds keys of, with how many keys each.
    pub fn roles(&self) -> BTreeMap<Role, usize> {
        let mut out = BTreeMap::new();
        for k in self.keys.values() {
            *out.entry(k.role).or_insert(0) += 1;
        }
        out
    }

    /// The role whose key signed `body`, from its [`ATTRIBUTE`] value.
    pub fn verify(&self, body: &str, signature: Option<&str>) -> std::result::Result<Role, Refused> {
        let sig = signature.ok_or(Refused::Unsigned)?;
        let mut parts = sig.splitn(4, '.');
        let (Some("v1"), Some(role), Some(id), Some(mac)) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(Refused::Malformed);
        };
        let key = self
            .keys
            .get(id)
            .filter(|k| k.role.as_str() == role)
            .ok_or_else(|| Refused::UnknownKey { role: role.chars().take(16).collect(), id: id.chars().take(16).collect() })?;
        let given = base64::engine::general_purpose::STANDARD_NO_PAD.decode(mac).map_err(|_| Refused::Malformed)?;
        // Compared in constant time.
        key.message_mac(body).verify_slice(&given).map_err(|_| Refused::Mismatch(key.role))?;
        Ok(key.role)
    }
}

impl Keyring {
    /// Whether `token` is a submitter's token for chunk `chunk` of `job` (see [`Key::chunk_token`]).
    pub fn verify_chunk_token(&self, job: &str, chunk: u32, token: Option<&str>) -> std::result::Result<(), Refused> {
        let token = token.ok_or(Refused::ChunkToken)?;
        let id = token.split_once('.').map(|(id, _)| id).ok_or(Refused::ChunkToken)?;
        let key = self.keys.get(id).filter(|k| k.role == Role::Submitter).ok_or(Refused::ChunkToken)?;
        // Compared in constant time, as a MAC over the expected token.
        let expected = key.chunk_token(job, chunk);
        let given = hmac(&key.secret, &[token.as_bytes()]).finalize().into_bytes();
        hmac(&key.secret, &[expected.as_bytes()]).verify_slice(&given).map_err(|_| Refused::ChunkToken)
    }
}

/// An HMAC-SHA256 under `secret` over `parts` in turn (the callers' labels keep the uses apart).
fn hmac(secret: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_names_its_role_and_verifies_only_with_its_body_and_key() {
        let p = Key::generate(Role::Processor);
        let s = Key::generate(Role::Submitter);
        let ring = Keyring::new([p.clone(), s.clone()]);
        let sig = p.sign("{\"kind\":\"chunk\"}");
        assert_eq!(ring.verify("{\"kind\":\"chunk\"}", Some(&sig)), Ok(Role::Processor));
        assert_eq!(ring.verify("{\"kind\":\"abandon\"}", Some(&sig)), Err(Refused::Mismatch(Role::Processor)), "another body");
        // A processor claiming the submitter's role with its own key: no submitter key has its id.
        let claimed = sig.replacen("processor", "submitter", 1);
        assert!(matches!(ring.verify("{\"kind\":\"chunk\"}", Some(&claimed)), Err(Refused::UnknownKey { .. })));
        assert_eq!(ring.verify("x", None), Err(Refused::Unsigned));
        assert_eq!(ring.verify("x", Some("v2.a.b.c")), Err(Refused::Malformed));
        let other = Key::generate(Role::Processor);
        assert!(matches!(ring.verify("x", Some(&other.sign("x"))), Err(Refused::UnknownKey { .. })), "a key the ring does not hold");
        // Rotation: both keys of a role verify while both are in the ring.
        let both = Keyring::new([p.clone(), other.clone()]);
        assert_eq!(both.verify("x", Some(&other.sign("x"))), Ok(Role::Processor));
        assert_eq!(both.verify("x", Some(&p.sign("x"))), Ok(Role::Processor));
        assert_eq!(both.roles().get(&Role::Processor), Some(&2));
    }

    #[test]
    fn a_chunk_token_is_its_submitters_for_that_chunk_only() {
        let s = Key::generate(Role::Submitter);
        let p = Key::generate(Role::Processor);
        let ring = Keyring::new([s.clone(), p.clone()]);
        let t = s.chunk_token("job-1", 3);
        assert_eq!(ring.verify_chunk_token("job-1", 3, Some(&t)), Ok(()));
        assert_eq!(ring.verify_chunk_token("job-1", 4, Some(&t)), Err(Refused::ChunkToken), "another chunk");
        assert_eq!(ring.verify_chunk_token("job-2", 3, Some(&t)), Err(Refused::ChunkToken), "another job");
        assert_eq!(ring.verify_chunk_token("job-1", 3, Some(&p.chunk_token("job-1", 3))), Err(Refused::ChunkToken), "a processor's key makes none");
        assert_eq!(ring.verify_chunk_token("job-1", 3, None), Err(Refused::ChunkToken));
    }

    #[test]
    fn key_files_round_trip_and_bad_ones_say_where() {
        let k = Key::generate(Role::Operator);
        let back = Key::parse(&format!("# the operator's key\n{}", k.to_line())).unwrap();
        assert_eq!((back.role(), back.id()), (Role::Operator, k.id()));
        assert!(Key::parse("operator c2hvcnQ=").unwrap_err().contains("at least 32 bytes"));
        assert!(Key::parse("\n\nboss AAAA").unwrap_err().starts_with("line 3: unknown role"));
        assert!(Key::parse("processor !!!").unwrap_err().contains("not base64"));
        assert!(!format!("{k:?}").contains(&k.to_line()[10..20]), "Debug shows no secret: {k:?}");
    }
}
