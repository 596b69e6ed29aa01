//! Step 2 of `prepare` on Linux: MLX itself, from the `mlx-cpu` wheel on PyPI
//! (`libmlx.so`, headers and a CMake package), with Debian's OpenBLAS serving
//! its BLAS and LAPACK.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{bail, Context, Result};
use crate::{files, python};

/// The MLX version that mlx-sys 0.7.0's mlx-c is pinned to.
pub const MLX_VERSION: &str = "0.32.2";
const PLATFORM: &str = "manylinux_2_35_x86_64";
const WHEEL_SHA256: &str = "fc5d31b90fc4f457b2f9614ed45651a567d22a6a11a03d114a90a4e10bdd8878";
/// Written last into the extracted wheel: its presence means the step is done.
const READY: &str = ".kvcache-ready";

/// The extracted wheel.
pub struct MlxWheel {
    /// `<extracted>/mlx`: holds `lib/libmlx.so`, `include/` and `share/cmake/MLX`.
    pub prefix: PathBuf,
}

impl MlxWheel {
    pub fn lib_dir(&self) -> PathBuf {
        self.prefix.join("lib")
    }
}

pub fn ensure(cache: &Path) -> Result<MlxWheel> {
    const STEP: &str = "prepare: MLX CPU wheel";
    if std::env::consts::ARCH != "x86_64" {
        bail!(
            "MLX on Linux is set up for x86_64 only (this machine is {}): no pinned mlx-cpu wheel for it",
            std::env::consts::ARCH
        );
    }
    let dir = cache.join(format!("mlx-cpu-{MLX_VERSION}"));
    let extracted = dir.join("extracted");
    let wheel = MlxWheel {
        prefix: extracted.join("mlx"),
    };
    if extracted.join(READY).is_file() {
        println!("{STEP}: already done ({})", extracted.display());
    } else {
        let download = dir.join("download");
        let file = python::download_wheel("mlx-cpu", MLX_VERSION, Some(PLATFORM), &download)?;
        files::verify_sha256(&file, WHEEL_SHA256)?;
        let staging = dir.join("extracted.tmp");
        python::unzip(&file, &staging)?;
        if !staging.join("mlx/lib/libmlx.so").is_file() {
            bail!("{} has no mlx/lib/libmlx.so", file.display());
        }
        files::write(&staging.join(READY), format!("mlx-cpu {MLX_VERSION}\n"))?;
        files::remove_all(&extracted)?;
        files::rename(&staging, &extracted)?;
        files::remove_all(&download)?;
        println!("{STEP}: done ({})", extracted.display());
    }
    link_openblas(&extracted.join("mlx_cpu.libs"))?;
    Ok(wheel)
}

/// Points the wheel's bundled reference BLAS and LAPACK (found by `libmlx.so`
/// through its RPATH) at Debian's OpenBLAS, which is 10-20x faster with the same
/// results. The originals are kept as `*.reference`.
fn link_openblas(libs: &Path) -> Result<()> {
    const STEP: &str = "prepare: OpenBLAS for MLX";
    let Some(openblas) = find_openblas() else {
        println!("{STEP}: libopenblas.so.0 not found, MLX keeps the wheel's slow reference BLAS");
        return Ok(());
    };
    let mut linked = Vec::new();
    let entries = fs::read_dir(libs).context(|| format!("listing {}", libs.display()))?;
    for entry in entries {
        let entry = entry.context(|| format!("listing {}", libs.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let is_blas = name.starts_with("libblas-") || name.starts_with("liblapack-");
        if !is_blas || name.ends_with(".reference") {
            continue;
        }
        let path = entry.path();
        if fs::read_link(&path).is_ok_and(|target| target == openblas) {
            continue;
        }
        let reference = libs.join(format!("{name}.reference"));
        if fs::symlink_metadata(&reference).is_err() {
            files::rename(&path, &reference)?;
        } else {
            files::remove_all(&path)?;
        }
        symlink(&openblas, &path)?;
        linked.push(name);
    }
    if linked.is_empty() {
        println!("{STEP}: already done ({})", openblas.display());
    } else {
        println!("{STEP}: done ({} -> {})", linked.join(", "), openblas.display());
    }
    Ok(())
}

fn find_openblas() -> Option<PathBuf> {
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let found = [multiarch.as_str(), "/usr/lib64", "/usr/lib", "/usr/local/lib"]
        .into_iter()
        .map(|dir| Path::new(dir).join("libopenblas.so.0"))
        .find(|path| path.exists());
    found
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> Result<()> {
    std::os::unix::fs::symlink(target, link)
        .context(|| format!("linking {} to {}", link.display(), target.display()))
}

#[cfg(not(unix))]
fn symlink(_target: &Path, link: &Path) -> Result<()> {
    bail!("cannot link {} on this platform", link.display())
}
