//! A CUDA *build* toolchain without a GPU or a CUDA install, under
//! `<cache>/cuda/`:
//!
//! - `pip/`: nvcc, the runtime, the crt headers, cicc (nvvm) and CCCL from
//!   NVIDIA's PyPI wheels (`pip install --target`), pinned to CUDA 13.0: the
//!   PTX in the binaries is compiled by the GPU machine's driver when it loads
//!   it, and a driver only loads PTX from an nvcc no newer than itself (the
//!   lent H100 has driver 580 = CUDA 13.0; PTX from 13.1 fails there with
//!   `CUDA_ERROR_UNSUPPORTED_PTX_VERSION`);
//! - `home/`: a `CUDA_HOME`-like tree (`bin`, `include`, `nvvm`, `lib` link
//!   into `pip/`; `lib64` holds the wheel's `libcudart`) with link-only stub
//!   libraries in `lib64/stubs` for the five libraries cudarc links with its
//!   `dynamic-linking` feature (candle-core turns it on): `-lcuda -lnvrtc
//!   -lcurand -lcublas -lcublasLt`. Each stub exports every function cudarc
//!   declares for its library (read from cudarc's `src/<module>/sys/mod.rs`, a
//!   superset of what its rlib leaves undefined) and carries the real
//!   library's soname, so the binaries load the real one on the GPU machine.
//!
//! Each part is stamped; a second run only checks the stamps.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{bail, Context, Result};
use crate::layout::Layout;
use crate::{files, shell};

/// nvcc, runtime, crt and nvvm wheels (one CUDA release).
pub const CUDA_VERSION: &str = "13.0.88";
/// The CCCL wheel of that release.
const CCCL_VERSION: &str = "13.0.85";
/// The compute capability the kernels are built for when `CUDA_COMPUTE_CAP`
/// is unset: sm_90, the H100 and H200 the project is lent.
pub const DEFAULT_COMPUTE_CAP: &str = "90";

/// `lib<name>` stubs: (library name, cudarc module, the real library's soname).
const STUBS: [(&str, &str, &str); 5] = [
    ("cuda", "driver", "libcuda.so.1"),
    ("nvrtc", "nvrtc", "libnvrtc.so.13"),
    ("curand", "curand", "libcurand.so.10"),
    ("cublas", "cublas", "libcublas.so.13"),
    ("cublasLt", "cublaslt", "libcublasLt.so.13"),
];

/// The prepared toolchain.
pub struct Toolchain {
    /// The `CUDA_HOME`-like tree.
    pub home: PathBuf,
}

impl Toolchain {
    /// The wheel's CUDA runtime, which the binaries load at run time.
    pub fn libcudart(&self) -> PathBuf {
        self.home.join("lib64").join("libcudart.so.13")
    }

    pub fn nvcc(&self) -> PathBuf {
        self.home.join("bin").join("nvcc")
    }

    /// The environment a cargo build with `--features cuda` needs: set on the
    /// cargo command only, never on xtask's own process.
    pub fn envs(&self) -> Vec<(String, OsString)> {
        let home = self.home.as_os_str().to_owned();
        let bin = self.home.join("bin");
        let lib64 = self.home.join("lib64");
        let stubs = lib64.join("stubs");
        let mut path = vec![bin];
        path.extend(std::env::var_os("PATH").iter().flat_map(std::env::split_paths));
        let mut library_path = vec![lib64, stubs];
        library_path.extend(
            std::env::var_os("LIBRARY_PATH")
                .iter()
                .flat_map(std::env::split_paths),
        );
        let join = |dirs: Vec<PathBuf>| std::env::join_paths(dirs).unwrap_or_default();
        let cap = std::env::var_os("CUDA_COMPUTE_CAP")
            .filter(|cap| !cap.is_empty())
            .unwrap_or_else(|| DEFAULT_COMPUTE_CAP.into());
        vec![
            ("CUDA_HOME".to_owned(), home.clone()),
            ("CUDA_PATH".to_owned(), home.clone()),
            ("CUDA_ROOT".to_owned(), home),
            ("NVCC".to_owned(), self.nvcc().into_os_string()),
            ("PATH".to_owned(), join(path)),
            ("CUDA_COMPUTE_CAP".to_owned(), cap),
            ("LIBRARY_PATH".to_owned(), join(library_path)),
        ]
    }
}

/// Prepares (or finds prepared) the toolchain under `<cache>/cuda/`.
pub fn ensure(layout: &Layout) -> Result<Toolchain> {
    const STEP: &str = "cuda-bundle: CUDA build toolchain";
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        bail!(
            "the CUDA build toolchain is set up for Linux x86_64 only (NVIDIA's nvcc wheels), not {} {}",
            std::env::consts::OS,
            std::env::consts::ARCH
        );
    }
    let dir = layout.cache.join("cuda");
    let pip = dir.join("pip");
    let home = dir.join("home");
    let toolchain = Toolchain { home: home.clone() };

    let cudarc = cudarc_source(&layout.root)?;
    let stub_sources = stub_sources(&cudarc)?;
    let stamp = home.join(".kvcache-ready");
    let expected = format!(
        "nvcc {CUDA_VERSION}, cccl {CCCL_VERSION}, stubs from {} ({})\n",
        cudarc.file_name().unwrap_or_default().to_string_lossy(),
        files::sha256_bytes(
            &stub_sources
                .iter()
                .map(|(_, _, c)| c.as_bytes())
                .collect::<Vec<_>>()
        ),
    );
    let links = home_links(&pip, &home);
    let links_ok = links
        .iter()
        .all(|(target, link)| std::fs::read_link(link).is_ok_and(|t| &t == target));
    if links_ok && toolchain.nvcc().is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == expected)
    {
        println!("{STEP}: already done ({})", home.display());
        return Ok(toolchain);
    }

    install_wheels(&pip)?;
    for (target, link) in &links {
        ensure_symlink(target, link)?;
    }
    build_stubs(&home.join("lib64").join("stubs"), &stub_sources)?;
    smoke_test(&toolchain)?;
    files::write(&stamp, &expected)?;
    println!("{STEP}: done ({})", home.display());
    Ok(toolchain)
}

/// The links of the `CUDA_HOME`-like tree: (target, link).
fn home_links(pip: &Path, home: &Path) -> Vec<(PathBuf, PathBuf)> {
    let cu = pip.join("nvidia").join("cu13");
    let lib64 = home.join("lib64");
    let mut links: Vec<(PathBuf, PathBuf)> = ["bin", "include", "nvvm", "lib"]
        .into_iter()
        .map(|d| (cu.join(d), home.join(d)))
        .collect();
    for file in ["libcudart.so.13", "libcudart_static.a", "libcudadevrt.a"] {
        links.push((cu.join("lib").join(file), lib64.join(file)));
    }
    // candle-kernels links `-lcudart`.
    links.push((PathBuf::from("libcudart.so.13"), lib64.join("libcudart.so")));
    links
}

/// nvcc and friends from PyPI into `pip/`, unless its stamp says they are there.
fn install_wheels(pip: &Path) -> Result<()> {
    const STEP: &str = "cuda-bundle: nvcc wheels";
    let stamp = pip.join(format!(".installed-{CUDA_VERSION}-{CCCL_VERSION}"));
    if stamp.is_file() && pip.join("nvidia/cu13/bin/nvcc").is_file() {
        println!("{STEP}: already done ({})", pip.display());
        return Ok(());
    }
    let staging = pip.with_extension("tmp");
    files::remove_all(&staging)?;
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--target",
    ])
    .arg(&staging)
    .args([
        format!("nvidia-cuda-nvcc=={CUDA_VERSION}"),
        format!("nvidia-cuda-runtime=={CUDA_VERSION}"),
        format!("nvidia-cuda-crt=={CUDA_VERSION}"),
        format!("nvidia-nvvm=={CUDA_VERSION}"),
        format!("nvidia-cuda-cccl=={CCCL_VERSION}"),
    ]);
    shell::run(&mut cmd)?;
    if !staging.join("nvidia/cu13/bin/nvcc").is_file() {
        bail!(
            "the nvcc wheels have no nvidia/cu13/bin/nvcc in {}",
            staging.display()
        );
    }
    files::write(&staging.join(stamp.file_name().unwrap_or_default()), CUDA_VERSION)?;
    files::remove_all(pip)?;
    files::rename(&staging, pip)?;
    println!("{STEP}: done ({})", pip.display());
    Ok(())
}

/// The unpacked source of the cudarc version in the workspace's Cargo.lock
/// (`cargo fetch` unpacks it if it is not yet).
fn cudarc_source(root: &Path) -> Result<PathBuf> {
    let lock = files::read_to_string(&root.join("Cargo.lock"))?;
    let Some(version) = locked_version(&lock, "cudarc") else {
        bail!("Cargo.lock has no cudarc package: is candle's cuda feature still in the workspace?");
    };
    let name = format!("cudarc-{version}");
    if let Some(dir) = registry_source(&name) {
        return Ok(dir);
    }
    shell::run(
        Command::new(crate::cargo::program())
            .current_dir(root)
            .arg("fetch"),
    )?;
    match registry_source(&name) {
        Some(dir) => Ok(dir),
        None => bail!("{name} is not unpacked in cargo's registry even after `cargo fetch`"),
    }
}

/// The version of `package` in a Cargo.lock (the first entry of that name).
fn locked_version(lock: &str, package: &str) -> Option<String> {
    let entry = lock
        .split("[[package]]")
        .find(|entry| entry.contains(&format!("\nname = \"{package}\"\n")))?;
    let version = entry.split("\nversion = \"").nth(1)?.split('"').next()?;
    Some(version.to_owned())
}

/// `$CARGO_HOME/registry/src/*/<name_version>`, if unpacked.
fn registry_source(name_version: &str) -> Option<PathBuf> {
    let cargo_home = std::env::var_os("CARGO_HOME")
        .filter(|home| !home.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    let mut indexes: Vec<PathBuf> = std::fs::read_dir(cargo_home.join("registry").join("src"))
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .collect();
    indexes.sort();
    indexes
        .into_iter()
        .map(|index| index.join(name_version))
        .find(|dir| dir.join("src").is_dir())
}

/// Each stub's (library name, soname, C source).
fn stub_sources(cudarc: &Path) -> Result<Vec<(&'static str, &'static str, String)>> {
    STUBS
        .iter()
        .map(|&(lib, module, soname)| {
            let sys = cudarc.join("src").join(module).join("sys").join("mod.rs");
            let functions = declared_functions(&files::read_to_string(&sys)?);
            if functions.is_empty() {
                bail!("{} declares no functions: cudarc's layout changed", sys.display());
            }
            let mut source =
                format!("/* link-only stub for lib{lib} ({soname}), from cudarc's {module}/sys */\n");
            for function in functions {
                source.push_str(&format!("void {function}(void) {{ __builtin_trap(); }}\n"));
            }
            Ok((lib, soname, source))
        })
        .collect()
}

/// The names of the functions a cudarc `sys/mod.rs` declares (indented
/// `fn name(` lines, in `extern` blocks), sorted and without repeats.
fn declared_functions(source: &str) -> Vec<String> {
    let mut names: Vec<String> = source
        .lines()
        .filter(|line| line.starts_with(char::is_whitespace))
        .filter_map(|line| line.trim_start().strip_prefix("fn "))
        .filter_map(|rest| {
            let end = rest.find('(')?;
            let name = &rest[..end];
            (!name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                .then(|| name.to_owned())
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn build_stubs(dir: &Path, sources: &[(&str, &str, String)]) -> Result<()> {
    files::create_dir_all(dir)?;
    for (lib, soname, source) in sources {
        let c = dir.join(format!("lib{lib}.c"));
        files::write(&c, source)?;
        shell::run(
            Command::new("cc")
                .args(["-shared", "-fPIC", "-O0", "-o"])
                .arg(dir.join(format!("lib{lib}.so")))
                .arg(format!("-Wl,-soname,{soname}"))
                .arg(&c),
        )?;
        files::remove_all(&c)?;
    }
    Ok(())
}

/// nvcc compiles a kernel using the fp16 and bf16 headers to sm_90 PTX.
fn smoke_test(toolchain: &Toolchain) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("xtask-nvcc-{}", std::process::id()));
    files::remove_all(&dir)?;
    files::create_dir_all(&dir)?;
    let source = dir.join("k.cu");
    files::write(
        &source,
        "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <stdint.h>\n\
         extern \"C\" __global__ void k(const __nv_bfloat16* a, __half* b, uint32_t n) {\n\
         \x20   uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;\n\
         \x20   if (i < n) b[i] = __float2half(__bfloat162float(a[i]) * 2.0f);\n}\n",
    )?;
    let ptx = dir.join("k.ptx");
    let result = shell::run(
        Command::new(toolchain.nvcc())
            .args(["-ptx", "-arch=sm_90", "-o"])
            .arg(&ptx)
            .arg(&source),
    );
    let text = std::fs::read_to_string(&ptx).context(|| format!("reading {}", ptx.display()));
    files::remove_all(&dir)?;
    result?;
    if !text?.lines().any(|line| line.starts_with(".target sm_90")) {
        bail!("nvcc's smoke test made PTX that is not for sm_90");
    }
    Ok(())
}

/// Makes `link` a symbolic link to `target`, replacing whatever is there.
fn ensure_symlink(target: &Path, link: &Path) -> Result<()> {
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    if let Some(parent) = link.parent() {
        files::create_dir_all(parent)?;
    }
    files::remove_all(link)?;
    std::os::unix::fs::symlink(target, link)
        .context(|| format!("linking {} to {}", link.display(), target.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_functions_are_the_indented_fn_lines() {
        // cudarc's layout: a wrapper per function, the declaration in an
        // `extern` block inside it.
        let source = "pub unsafe fn cuInit(flags: u32) -> CUresult {\n    extern \"C\" {\n        \
                      fn cuInit(flags: u32) -> CUresult;\n    }\n}\n    \
                      fn cuDriverGetVersion(\n        v: *mut i32,\n    ) -> CUresult;\n    \
                      fn cuInit(flags: u32) -> CUresult;\nfn top_level() {}\n    \
                      fn helper<T>(x: T) {}\n    pub fn indented_wrapper() {}\n";
        assert_eq!(declared_functions(source), ["cuDriverGetVersion", "cuInit"]);
    }

    #[test]
    fn the_locked_version_is_read() {
        let lock = "[[package]]\nname = \"cudarc-extra\"\nversion = \"9\"\n\n\
                    [[package]]\nname = \"cudarc\"\nversion = \"0.19.10\"\nsource = \"x\"\n";
        assert_eq!(locked_version(lock, "cudarc").as_deref(), Some("0.19.10"));
        assert_eq!(locked_version(lock, "candle"), None);
    }
}
