//! CPU feature detection, and the macro that dispatches a kernel to its AVX + FMA build.

// Run-time dispatch to AVX + FMA builds of the kernels: the only unsafe code of the crate.
// Each `kernel` is the generic kernel (`#[inline(always)]`, so it is compiled inside `kernel`
// with its target features); it is called only right after `avx_fma()` found them.

/// Whether this CPU runs the AVX + FMA builds.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // elsewhere only the tests ask
pub(super) fn avx_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `fn $name(args) { $generic::<FMA>(args) }` with `FMA` true, in a build with AVX + FMA
/// enabled, where this CPU has them: the one place the kernels' dispatch is written.
macro_rules! with_avx_fma {
    ($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) => $generic:ident) => {
        $(#[$doc])*
        #[allow(unsafe_code)]
        $vis fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            if $crate::coded_attention::cpu::avx_fma() {
                #[target_feature(enable = "avx,fma")]
                fn kernel($($arg: $ty),*) {
                    $generic::<true>($($arg),*)
                }
                // SAFETY: `avx_fma()` just found AVX and FMA on this CPU.
                return unsafe { kernel($($arg),*) };
            }
            $generic::<false>($($arg),*)
        }
    };
}
pub(crate) use with_avx_fma;
