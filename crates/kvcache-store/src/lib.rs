//! A tiered store of KV-cache prefixes that outlives the process (work in progress).
#![deny(missing_docs)]
