//! A Python virtual environment with the official `openai` client, for the
//! server's smoke test (crates/kvcache-server/tests/python_client.rs).
//! Made once under the download cache; the test gets its interpreter in
//! [`PYTHON_ENV`].

use std::path::{Path, PathBuf};

use crate::error::Result;

/// Environment variable through which the smoke test gets the interpreter.
pub const PYTHON_ENV: &str = "KVCACHE_OPENAI_PYTHON";

/// Set to `1` by `cargo xtask test`: the smoke test fails instead of
/// skipping when the interpreter is missing.
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_OPENAI_PYTHON";

/// The pinned client version.
const OPENAI_VERSION: &str = "2.8.0";

/// The virtual environment's interpreter, made and filled on first use.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    crate::python::venv_with(
        cache,
        "prepare: python openai client",
        "openai",
        "openai",
        OPENAI_VERSION,
    )
}
