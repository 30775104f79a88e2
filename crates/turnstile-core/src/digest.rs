//! Content digests: `sha256:` + lowercase hex of SHA-256 over RFC 8785 (JCS) canonical JSON.
//!
//! Canonicalisation is done by the maintained `serde_jcs` crate (streamed straight into the
//! hasher, no intermediate buffer); `tests/it/digest.rs` checks it against the RFC 8785
//! examples and against a second implementation (`serde_json_canonicalizer`).

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::fmt;
use std::io;

/// A `sha256:<64 lowercase hex>` digest.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Digest(String);

impl Digest {
    /// Digest of raw bytes (used for exact request bodies).
    pub fn of_bytes(bytes: &[u8]) -> Digest {
        let hash = Sha256::digest(bytes);
        Digest::from_hash(&hash)
    }

    /// Digest of the RFC 8785 canonical form of a serialisable value.
    ///
    /// Serialising a `serde_json::Value` or a plain derived struct cannot fail: JCS only
    /// rejects non-finite floats, which serde_json values cannot hold.
    pub fn of_canonical<T: Serialize + ?Sized>(value: &T) -> Digest {
        let mut writer = HashWriter(Sha256::new());
        // Invariant: our values are JSON-representable (no NaN/inf, string keys), so JCS
        // serialisation into an infallible writer does not fail.
        serde_jcs::to_writer(&mut writer, value).expect("JCS of a JSON value is infallible");
        Digest::from_hash(&writer.0.finalize())
    }

    fn from_hash(hash: &[u8]) -> Digest {
        let mut text = String::with_capacity(7 + 64);
        text.push_str("sha256:");
        text.push_str(&hex::encode(hash));
        Digest(text)
    }

    /// Parse a digest string; `None` unless it is `sha256:` + 64 lowercase hex digits.
    pub fn parse(text: &str) -> Option<Digest> {
        let hex_part = text.strip_prefix("sha256:")?;
        let well_formed = hex_part.len() == 64
            && hex_part
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        well_formed.then(|| Digest(text.to_owned()))
    }

    /// The digest as `sha256:<hex>`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// RFC 8785 canonical bytes of a value (for tests, manifests and debugging).
pub fn canonical_bytes<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // Invariant: see `Digest::of_canonical`.
    serde_jcs::to_vec(value).expect("JCS of a JSON value is infallible")
}

struct HashWriter(Sha256);

impl io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
