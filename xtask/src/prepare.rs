//! `prepare`: everything a fresh machine lacks before the workspace's tests can
//! run, each step idempotent (a second run prints "already done" per step).

use crate::cargo::Cargo;
use crate::error::{bail, Result};
use crate::layout::Layout;
use crate::{mlx_sys_patch, mlx_wheel, model, system_packages};

/// Whether the command about to run needs the real model file.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Model {
    Needed,
    NotNeeded,
}

/// Prepares the MLX build (on Linux) and, when asked, the model; returns the
/// cargo runner configured for them.
pub fn prepare(layout: &Layout, model: Model) -> Result<Cargo> {
    let mut cargo = if cfg!(target_os = "macos") {
        println!("prepare: MLX: macOS builds the published mlx-rs natively, nothing to set up");
        Cargo::plain(&layout.root)
    } else if cfg!(target_os = "linux") {
        system_packages::ensure()?;
        let wheel = mlx_wheel::ensure(&layout.cache)?;
        let patched = mlx_sys_patch::ensure(layout, &wheel)?;
        Cargo::with_mlx(&layout.root, patched, wheel.lib_dir())
    } else {
        bail!("xtask supports Linux and macOS, not {}", std::env::consts::OS);
    };
    if model == Model::Needed {
        add_model(layout, &mut cargo)?;
    }
    Ok(cargo)
}

/// Only the model, for tasks that never build mlx-sys (`test-metal`, `test-cuda`).
pub fn prepare_model_only(layout: &Layout) -> Result<Cargo> {
    let mut cargo = Cargo::plain(&layout.root);
    add_model(layout, &mut cargo)?;
    Ok(cargo)
}

fn add_model(layout: &Layout, cargo: &mut Cargo) -> Result<()> {
    let path = model::ensure(&layout.cache)?;
    cargo.set_env(model::MODEL_ENV, path);
    add_gemma(layout, cargo);
    Ok(())
}

/// Gemma 3 for the sliding-window tests and benchmarks. Not fatal: without it
/// (no network on a fresh machine) those tests skip, saying why, and everything
/// else runs.
fn add_gemma(layout: &Layout, cargo: &mut Cargo) {
    match model::gemma::ensure(&layout.cache) {
        Ok(path) => cargo.set_env(model::GEMMA_ENV, path),
        Err(err) => println!(
            "prepare: gemma: not prepared ({err}); tests needing {} will skip",
            model::GEMMA_ENV
        ),
    }
}
