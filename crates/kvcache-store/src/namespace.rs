//! Namespace handling: the [`Scope`] a block belongs to (model fingerprint and
//! tenant namespace), and the two ways it is written down: as bytes inside every
//! block key, and as the prefix of every Redis key.
//!
//! Both encodings are injective by construction. In the hash the namespace is
//! preceded by a tag (shared or salted) and its length, so `""` and any salt,
//! or two salts, never produce the same input.
//!
//! In Redis keys the prefixes are also prefix-free: no scope's prefix is a
//! prefix of another's, so a per-tenant `SCAN`, purge or ACL pattern
//! (`{prefix}*`) reaches that tenant's keys only. A namespace may contain `:`,
//! so it is written length first: `kvc2:{fp16}:{len}:{namespace}:`, the length
//! in decimal bytes without leading zeros. Two prefixes one of which starts the
//! other have the same digits before the `:` that ends the length (digits
//! cannot contain it), hence the same length, hence the same namespace. (Until
//! the key format's version 2 the prefix was `kvc:{fp16}:{namespace}:`, and
//! salt `x`'s prefix covered salt `x:m`'s keys. Stored blocks are a cache:
//! those under the old prefix are no longer read and age out through Redis's
//! LRU or TTL.) [`Namespace`](kvcache_api::Namespace) admits no glob character (`*?[]\`), so the
//! prefix can be used in a pattern as is.

pub use kvcache_api::block_key::Scope;

/// The version of the Redis key format, first in every key.
const REDIS_KEY_VERSION: &str = "kvc2";

/// The prefix of every Redis key of `scope`: `kvc2:{first 16 hex digits of the
/// fingerprint}:{namespace's length in bytes}:{namespace}:`; no scope's prefix is
/// a prefix of another's (the module docs).
pub fn redis_prefix(scope: &Scope<'_>) -> String {
    prefix_of(&scope.fingerprint.to_hex()[..16], scope.namespace.as_str())
}

/// [`redis_prefix`] for a fingerprint's 16 hex digits and a namespace of any
/// text (a [`Namespace`](kvcache_api::Namespace) is a subset).
fn prefix_of(fingerprint16: &str, namespace: &str) -> String {
    format!(
        "{REDIS_KEY_VERSION}:{fingerprint16}:{}:{namespace}:",
        namespace.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcache_api::{Fingerprint, Namespace};

    /// Namespaces that nest, end or start with `:`, look like lengths, or are
    /// empty, beyond what [`Namespace`] admits (unicode, spaces) too.
    const ADVERSARIAL: &[&str] = &[
        "", "x", "x:", "x:m", "x:m:", ":", "::", ":x", "1", "1:", "1:x", "11", "11:x", "2:x:", "0", "0:",
        "x:1:", "x:1:y", "kvc2", "é", "é:", "日本", "a b", "x*", "xx", "xm",
    ];

    fn fingerprints() -> [String; 2] {
        [
            Fingerprint([7; 32]).to_hex()[..16].to_owned(),
            Fingerprint([8; 32]).to_hex()[..16].to_owned(),
        ]
    }

    #[test]
    fn no_prefix_starts_another() {
        let mut prefixes = Vec::new();
        for fp in fingerprints() {
            for ns in ADVERSARIAL {
                prefixes.push(((fp.clone(), ns.to_string()), prefix_of(&fp, ns)));
            }
            // Long ones, whose lengths have more digits.
            for n in [9, 10, 11, 99, 100, 128] {
                let ns = "x:".repeat(n)[..n].to_owned();
                prefixes.push(((fp.clone(), ns.clone()), prefix_of(&fp, &ns)));
            }
        }
        for (a, pa) in &prefixes {
            for (b, pb) in &prefixes {
                if a != b {
                    assert!(
                        !pb.starts_with(pa.as_str()),
                        "{a:?}'s {pa:?} starts {b:?}'s {pb:?}"
                    );
                    // Nor any key under it: a manifest, a chunk, a tails set.
                    for kind in ["m:", "c:", "t:"] {
                        let key = format!("{pb}{kind}{}", "ab".repeat(32));
                        assert!(!key.starts_with(pa.as_str()), "{pa:?} covers {key:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn prefixes_of_valid_namespaces() {
        let fp = Fingerprint([7; 32]);
        let x = Namespace::new("x").unwrap();
        let xm = Namespace::new("x:m").unwrap();
        let shared = Namespace::shared();
        let fp16 = &fp.to_hex()[..16];
        assert_eq!(redis_prefix(&Scope::new(&fp, &x)), format!("kvc2:{fp16}:1:x:"));
        assert_eq!(redis_prefix(&Scope::new(&fp, &xm)), format!("kvc2:{fp16}:3:x:m:"));
        assert_eq!(
            redis_prefix(&Scope::new(&fp, &shared)),
            format!("kvc2:{fp16}:0::")
        );
        let (px, pxm) = (
            redis_prefix(&Scope::new(&fp, &x)),
            redis_prefix(&Scope::new(&fp, &xm)),
        );
        assert!(!pxm.starts_with(&px));
        // No glob character fits in a namespace: the prefix is a pattern as is.
        for c in ['*', '?', '[', ']', '\\'] {
            assert!(Namespace::new(&format!("x{c}")).is_err(), "{c}");
        }
    }
}
