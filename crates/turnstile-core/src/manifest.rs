//! `DispatchManifest v1` (`shared/spec/gateway-api.md`): what one dispatch will send, pinned
//! before any I/O. The manifest names the exact request bytes by digest; those bytes are stored
//! beside it and every attempt re-sends them, never a fresh render.
//!
//! Credentials and auth headers are never part of a manifest.

use crate::digest::Digest;
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
        let manifest_digest = Digest::of_canonical(&self);
        DispatchManifest {
            body: self,
            manifest_digest,
        }
    }
}

impl DispatchManifest {
    /// Whether `manifest_digest` matches the body (a stored manifest was not altered).
    pub fn is_intact(&self) -> bool {
        Digest::of_canonical(&self.body) == self.manifest_digest
    }
}
