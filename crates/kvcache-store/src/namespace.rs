//! Namespace handling: the [`Scope`] a block belongs to (model fingerprint and
//! tenant namespace), and the two ways it is written down: as bytes inside every
//! block key, and as the prefix of every Redis key.
//!
//! Both encodings are injective by construction. In the hash the namespace is
//! preceded by a tag (shared or salted) and its length, so `""` and any salt,
//! or two salts, never produce the same input. In Redis keys the namespace sits
//! between fixed-format parts (`kvc:{fp16}:` before, a one-letter kind and a
//! 64-digit hex key after), and [`Namespace`] admits no character that could
//! escape it.

use kvcache_api::{Fingerprint, Namespace};
use sha2::Digest;

/// The partition a block lives in: which model produced it and which tenant
/// may read it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scope<'a> {
    /// The model's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The tenant's namespace.
    pub namespace: &'a Namespace,
}

/// Tag of the shared namespace in key hashes.
const SHARED: u8 = 0;
/// Tag of a salted namespace in key hashes.
const SALTED: u8 = 1;

impl<'a> Scope<'a> {
    /// The scope of `namespace` under the model `fingerprint`.
    pub fn new(fingerprint: &'a Fingerprint, namespace: &'a Namespace) -> Self {
        Scope {
            fingerprint,
            namespace,
        }
    }

    /// Feeds the fingerprint and the tagged, length-prefixed namespace to `hasher`.
    pub(crate) fn hash_into(&self, hasher: &mut sha2::Sha256) {
        hasher.update(self.fingerprint.0);
        let ns = self.namespace.as_str().as_bytes();
        hasher.update([if self.namespace.is_shared() {
            SHARED
        } else {
            SALTED
        }]);
        hasher.update((ns.len() as u32).to_le_bytes());
        hasher.update(ns);
    }

    /// The prefix of every Redis key of this scope: `kvc:{first 16 hex digits of
    /// the fingerprint}:{namespace}:`.
    pub fn redis_prefix(&self) -> String {
        format!(
            "kvc:{}:{}:",
            &self.fingerprint.to_hex()[..16],
            self.namespace.as_str()
        )
    }
}
