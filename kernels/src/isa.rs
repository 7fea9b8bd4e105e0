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
}

impl Isa {
    /// Whether this CPU can run the path.
    #[must_use]
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => avx2_available(),
        }
    }

    /// The fastest path this CPU can run. Setting the environment variable
    /// `KVSAN_KERNELS_PORTABLE=1` before first use forces [`Isa::Portable`].
    #[must_use]
    pub fn detected() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let forced = std::env::var_os("KVSAN_KERNELS_PORTABLE").is_some_and(|v| v == "1");
            if !forced && Isa::Avx2.available() {
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
        [Isa::Portable, Isa::Avx2]
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
