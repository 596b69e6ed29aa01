//! Run-time choice of the instruction set used by the product kernels.

/// Instruction set of a product kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable scalar code, the reference path.
    Scalar,
    /// AVX2 + FMA + F16C: `maddubs`/`madd` on 256-bit registers, eight weight rows each.
    Avx2,
    /// AVX-512 F/BW/VL + VNNI: `dpbusd` on 512-bit registers, sixteen weight rows each.
    Avx512,
    /// Arm NEON (every AArch64 CPU): widening `i8` multiplies and pairwise
    /// adds on 128-bit registers, four weight rows each.
    Neon,
}

/// Environment variable forcing an instruction set (`scalar`, `avx2`, `avx512`, `neon`).
pub const ISA_ENV: &str = "KVCACHE_QUANT_ISA";

impl Isa {
    /// Whether this CPU can run the kernels of `self`.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// All instruction sets available on this CPU, scalar first, best last.
    pub fn available() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    /// Parses `scalar`, `avx2`, `avx512` or `neon` (case-insensitive).
    pub fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "neon" => Some(Isa::Neon),
            _ => None,
        }
    }

    /// The best available instruction set, unless [`ISA_ENV`] names an
    /// available one, which is then used instead. An unknown or unavailable
    /// name is ignored.
    pub fn detect() -> Isa {
        let forced = std::env::var(ISA_ENV).ok().and_then(|n| Isa::from_name(&n));
        match forced {
            Some(isa) if isa.is_available() => isa,
            _ => *Isa::available().last().unwrap_or(&Isa::Scalar),
        }
    }
}
