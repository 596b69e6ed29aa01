//! A Python virtual environment with NVIDIA Dynamo's runtime (`ai-dynamo-runtime`,
//! whose `python -m dynamo.indexer` is Dynamo's standalone KV indexer), for
//! kvcache-events' test against a router we did not write
//! (crates/kvcache-events/tests/dynamo.rs). Made once under the download cache;
//! the test gets its interpreter in [`PYTHON_ENV`]. Dynamo publishes wheels for
//! Linux (x86-64, aarch64) only: elsewhere nothing is made and the test skips.

use std::path::{Path, PathBuf};

use crate::error::Result;

/// Environment variable through which the test gets the interpreter.
pub const PYTHON_ENV: &str = "KVCACHE_DYNAMO_PYTHON";

/// Set to `1` by `cargo xtask test` where Dynamo has wheels: the test fails
/// instead of skipping when the interpreter is missing.
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_DYNAMO_PYTHON";

/// The pinned Dynamo version.
const DYNAMO_VERSION: &str = "1.6.1";

/// Whether Dynamo has wheels for this machine.
pub fn supported() -> bool {
    cfg!(target_os = "linux") && cfg!(any(target_arch = "x86_64", target_arch = "aarch64"))
}

/// The virtual environment's interpreter, made and filled on first use.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    crate::python::venv_with(
        cache,
        "prepare: python dynamo runtime",
        "dynamo",
        "ai-dynamo-runtime",
        DYNAMO_VERSION,
    )
}
