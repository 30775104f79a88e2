//! `DispatchManifest v1` (`shared/spec/gateway-api.md`): what one dispatch will send, pinned
//! before any I/O. The manifest names the exact request bytes by digest; those bytes are stored
//! beside it and every attempt re-sends them, never a fresh render.
//!
//! Credentials and auth headers are never part of a manifest.
//!
//! Invariants held here, each with where it is enforced and the tests that fail when it
//! breaks (moved from ARCHITECTURE.md, which keeps the cross-cutting ones):
//!
//! - `manifest_digest` is SHA-256 over the RFC 8785 form of the manifest body, whether sealed or
//!   checked intact. Enforced in `core/src/manifest.rs` (`ManifestBody::digest`: serde_json's bytes
//!   of the fields in sorted order, the generic canonicaliser when an integer is above 2^53; `seal`
//!   and `is_intact` both call it), `store/src/ops.rs::target_invalid`. Tests:
//!   `core/tests/it/digest.rs::a_manifest_digest_is_the_digest_of_the_canonical_body` (against
//!   `serde_json_canonicalizer` on generated bodies with escapable strings and integers either side
//!   of 2^53; red with two fields out of order, and without the 2^53 fallback); the store refuses a
//!   manifest integer above 2^53, whose digest cannot pin it:
//!   `store/tests/it/conformance.rs::a_manifest_integer_above_2_53_is_refused_since_its_digest_cannot_pin_it`
//!   (both databases; red without the check in `ops.rs::target_invalid`, which calls
//!   `ManifestBody::numbers_exact`, the rule the digest's fallback uses).

use crate::digest::{Digest, EXACT_INTEGER_MAX};
use crate::ids::Revision;
use serde::{Deserialize, Serialize};

/// The `format` string of a manifest.
pub const MANIFEST_FORMAT_V1: &str = "turnstile.manifest.v1";

/// The manifest's fields without its own digest; [`ManifestBody::seal`] adds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestBody {
    /// Always [`MANIFEST_FORMAT_V1`].
    pub format: String,
    /// Client-chosen id of the operation (idempotency scope of the dispatch).
    pub operation_id: String,
    /// Conversation id.
    pub conversation_id: String,
    /// Revision the request was rendered from.
    pub conversation_revision: Revision,
    /// Digest of the MessageSequence rendered.
    pub sequence_digest: Digest,
    /// Adapter id, e.g. `anthropic-messages@1`.
    pub adapter: String,
    /// Digest of the adapter's rendering rules.
    pub adapter_digest: Digest,
    /// Provider name (`openai`, `anthropic`, `gemini`, `sim`, …).
    pub provider: String,
    /// Model name.
    pub model: String,
    /// Digest of the declared tools.
    pub toolset_digest: Digest,
    /// Digest of the rendering policy (what was omitted and why, e.g. foreign reasoning).
    pub policy_digest: Digest,
    /// Output token cap sent.
    pub max_output_tokens: u64,
    /// Admission count of the final bytes, tool definitions included.
    pub prompt_tokens: u64,
    /// `sha256:` over the exact body bytes sent.
    pub request_digest: Digest,
}

/// A sealed manifest: the body plus `manifest_digest` over the canonical body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DispatchManifest {
    /// The fields.
    #[serde(flatten)]
    pub body: ManifestBody,
    /// `sha256:` over the RFC 8785 form of the manifest without this field.
    pub manifest_digest: Digest,
}

impl ManifestBody {
    /// Compute `manifest_digest` and seal.
    pub fn seal(self) -> DispatchManifest {
        let manifest_digest = self.digest();
        DispatchManifest {
            body: self,
            manifest_digest,
        }
    }

    /// Whether every integer of the body is at most 2^53, so exact as an IEEE double, which is
    /// how RFC 8785 (and so `manifest_digest`) reads JSON numbers. Above it two integers can be
    /// one double, and so one canonical body: the digest would not pin the number (the store
    /// refuses such a manifest).
    pub fn numbers_exact(&self) -> bool {
        [
            self.conversation_revision.0,
            self.max_output_tokens,
            self.prompt_tokens,
        ]
        .into_iter()
        .all(|number| number <= EXACT_INTEGER_MAX)
    }

    /// `sha256:` over the RFC 8785 form of the body: what `manifest_digest` is.
    ///
    /// The body holds only strings and integers, so serde_json's compact serialisation of its
    /// fields in sorted order is that form, and is hashed as it is written
    /// ([`Digest::of_sorted_serialization`]) instead of through a `serde_json::Value` (which
    /// was most of sealing a manifest, and of the store's check that it is intact). Above 2^53
    /// an integer may print differently as an IEEE double, so a body holding one takes the
    /// generic canonicaliser (the store refuses such a manifest: its digest cannot pin the
    /// number). `tests/it/digest.rs` compares both with an independent canonicaliser.
    pub fn digest(&self) -> Digest {
        // Destructured whole: a new field must be named here, and one then left out of
        // `SortedBody` is an unused variable (and fails the property test).
        let ManifestBody {
            format,
            operation_id,
            conversation_id,
            conversation_revision,
            sequence_digest,
            adapter,
            adapter_digest,
            provider,
            model,
            toolset_digest,
            policy_digest,
            max_output_tokens,
            prompt_tokens,
            request_digest,
        } = self;
        if !self.numbers_exact() {
            return Digest::of_canonical(self);
        }
        Digest::of_sorted_serialization(&SortedBody {
            adapter,
            adapter_digest,
            conversation_id,
            conversation_revision: conversation_revision.0,
            format,
            max_output_tokens: *max_output_tokens,
            model,
            operation_id,
            policy_digest,
            prompt_tokens: *prompt_tokens,
            provider,
            request_digest,
            sequence_digest,
            toolset_digest,
        })
    }
}

/// The body's fields in the order RFC 8785 sorts their names (all ASCII, so byte order).
#[derive(Serialize)]
struct SortedBody<'a> {
    adapter: &'a str,
    adapter_digest: &'a Digest,
    conversation_id: &'a str,
    conversation_revision: u64,
    format: &'a str,
    max_output_tokens: u64,
    model: &'a str,
    operation_id: &'a str,
    policy_digest: &'a Digest,
    prompt_tokens: u64,
    provider: &'a str,
    request_digest: &'a Digest,
    sequence_digest: &'a Digest,
    toolset_digest: &'a Digest,
}

impl DispatchManifest {
    /// Whether `manifest_digest` matches the body (a stored manifest was not altered).
    pub fn is_intact(&self) -> bool {
        self.body.digest() == self.manifest_digest
    }
}
