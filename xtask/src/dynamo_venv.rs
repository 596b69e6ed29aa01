//! A Python virtual environment with NVIDIA Dynamo's runtime (`ai-dynamo-runtime`,
//! whose `python -m dynamo.indexer` is Dynamo's standalone KV indexer), for
//! kvcache-events' test against a router we did not write
//! (crates/kvcache-events/tests/dynamo.rs). Made once under the download cache;
//! the test gets its interpreter in [`PYTHON_ENV`]. Dynamo publishes wheels for
//! Linux (x86-64, aarch64) only: elsewhere nothing is made and the test skips.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::Result;
use crate::{files, shell};

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
    const STEP: &str = "prepare: python dynamo runtime";
    let venv = cache.join("python").join(format!("dynamo-{DYNAMO_VERSION}"));
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
        &format!("ai-dynamo-runtime=={DYNAMO_VERSION}"),
    ]))?;
    files::write(&done, DYNAMO_VERSION)?;
    Ok(python)
}
