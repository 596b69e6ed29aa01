//! A Python virtual environment with the official `openai` client, for the
//! server's smoke test (crates/kvcache-server/tests/python_client.rs).
//! Made once under the download cache; the test gets its interpreter in
//! [`PYTHON_ENV`].

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::Result;
use crate::{files, shell};

/// Environment variable through which the smoke test gets the interpreter.
pub const PYTHON_ENV: &str = "KVCACHE_OPENAI_PYTHON";

/// Set to `1` by `cargo xtask test`: the smoke test fails instead of
/// skipping when the interpreter is missing.
pub const REQUIRE_ENV: &str = "KVCACHE_REQUIRE_OPENAI_PYTHON";

/// The pinned client version.
const OPENAI_VERSION: &str = "2.8.0";

/// The virtual environment's interpreter, made and filled on first use.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    const STEP: &str = "prepare: python openai client";
    let venv = cache.join("python").join(format!("openai-{OPENAI_VERSION}"));
    let python = venv.join("bin").join("python");
    let done = venv.join(".installed");
    if done.is_file() && python.is_file() {
        println!("{STEP}: already done ({})", venv.display());
        return Ok(python);
    }
    println!("{STEP}: creating {}", venv.display());
    files::remove_all(&venv)?;
    shell::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    shell::run(Command::new(&python).args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        &format!("openai=={OPENAI_VERSION}"),
    ]))?;
    files::write(&done, OPENAI_VERSION)?;
    Ok(python)
}
