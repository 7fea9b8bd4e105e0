//! Which instruction-set path the kernels run: detected once at run time.

use std::sync::OnceLock;

/// An instruction-set path of the CPU kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// Plain Rust, any CPU. The reference the SIMD path is tested against.
    Portable,
    /// x86-64 AVX2 + FMA + F16C (Haswell, Zen and later).
    Avx2,
    /// [`Isa::Avx2`] whose byte dot products inside a block take one VNNI
    /// instruction (`vpdpbusd`: AVX-VNNI, or AVX-512 VNNI with VL) where
    /// AVX2 takes two (Ice Lake, Sapphire Rapids, Zen 4 and later). The
    /// integer sums are the same, so the results are bit-identical to
    /// [`Isa::Avx2`]'s.
    Avx2Vnni,
    /// [`Isa::Avx2Vnni`] whose attention runs on 512-bit registers: a CPU
    /// with AVX-512 F, BW, VL, DQ and VNNI (Ice Lake, Sapphire Rapids,
    /// Zen 4 and later). The matmuls are [`Isa::Avx2Vnni`]'s.
    Avx512,
}

impl Isa {
    /// Whether this CPU can run the path.
    #[must_use]
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => avx2_available(),
            Isa::Avx2Vnni => avx2_available() && vnni_available(),
            Isa::Avx512 => avx2_available() && avx512_available(),
        }
    }

    /// The fastest path this CPU can run. Setting the environment variable
    /// `KVSAN_KERNELS_PORTABLE=1` before first use forces [`Isa::Portable`];
    /// `KVSAN_KERNELS_NO_AVX512=1` keeps [`Isa::Avx2Vnni`] on a CPU with
    /// AVX-512; `KVSAN_KERNELS_NO_VNNI=1` keeps [`Isa::Avx2`] on a CPU with
    /// VNNI (and AVX-512).
    #[must_use]
    pub fn detected() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let set = |name: &str| std::env::var_os(name).is_some_and(|v| v == "1");
            if set("KVSAN_KERNELS_PORTABLE") {
                Isa::Portable
            } else if set("KVSAN_KERNELS_NO_VNNI") && Isa::Avx2.available() {
                Isa::Avx2
            } else if !set("KVSAN_KERNELS_NO_AVX512") && Isa::Avx512.available() {
                Isa::Avx512
            } else if Isa::Avx2Vnni.available() {
                Isa::Avx2Vnni
            } else if Isa::Avx2.available() {
                Isa::Avx2
            } else {
                Isa::Portable
            }
        })
    }

    /// `self` if this CPU can run it, else [`Isa::Portable`].
    #[must_use]
    pub fn or_portable(self) -> Isa {
        if self.available() {
            self
        } else {
            Isa::Portable
        }
    }

    /// Every path this CPU can run (for tests that compare them).
    #[must_use]
    pub fn all_available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx2Vnni, Isa::Avx512]
            .into_iter()
            .filter(|i| i.available())
            .collect()
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_available() -> bool {
    false
}

/// Which VNNI encoding of `vpdpbusd` on 256-bit registers this CPU has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vnni {
    /// AVX-VNNI (VEX): Alder Lake, Sapphire Rapids, Zen 5.
    Avx,
    /// AVX-512 VNNI with VL (EVEX): Ice Lake, Zen 4.
    Avx512,
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn vnni() -> Option<Vnni> {
    static FOUND: OnceLock<Option<Vnni>> = OnceLock::new();
    *FOUND.get_or_init(|| {
        if is_x86_feature_detected!("avxvnni") {
            Some(Vnni::Avx)
        } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            Some(Vnni::Avx512)
        } else {
            None
        }
    })
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn vnni() -> Option<Vnni> {
    None
}

fn vnni_available() -> bool {
    vnni().is_some()
}
