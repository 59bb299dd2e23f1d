//! Run-time choice of the instruction set, so one binary runs well everywhere.
//!
//! [`Isa::detect`] picks the best level this CPU supports (overridable with the environment
//! variable `MX_QUANT_ISA=scalar|avx2|avx512`, for benchmarks and bug hunts). Every public kernel
//! also has a form that takes an explicit [`Isa`], which the tests use to run every level
//! against the scalar reference.

use std::sync::OnceLock;

/// An instruction-set level with its own kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust, always available; the reference the others are tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI (8-bit integer dot products) and VBMI (byte permutes), on
    /// top of [`Isa::Avx2`].
    Avx512,
    /// aarch64 Advanced SIMD (NEON).
    Neon,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Whether this CPU can run the level's kernels.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                    && std::arch::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.is_available()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::arch::is_x86_feature_detected!("avx512vbmi")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The levels this CPU supports, lowest first.
    pub fn available() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
    }

    /// The best supported level, or the one named by `MX_QUANT_ISA` when it is supported.
    /// Decided once per process.
    pub fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Isa::available().into_iter().max().unwrap_or(Isa::Scalar);
            match std::env::var("MX_QUANT_ISA")
                .ok()
                .as_deref()
                .and_then(Isa::from_name)
            {
                Some(wanted) if wanted.is_available() => wanted,
                _ => best,
            }
        })
    }

    /// Parses `scalar`, `avx2`, `avx512` or `neon`.
    pub fn from_name(name: &str) -> Option<Isa> {
        match name.to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "neon" => Some(Isa::Neon),
            _ => None,
        }
    }

    /// Lower-case name, as accepted by [`Isa::from_name`].
    pub const fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_simd_exists_where_it_must() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert!(Isa::available().contains(&Isa::Scalar));
        // NEON is part of the aarch64 baseline: if it is missing here, the NEON kernels' tests
        // would pass without running, so refuse.
        #[cfg(target_arch = "aarch64")]
        assert!(Isa::Neon.is_available());
        assert!(Isa::detect().is_available());
    }
}
