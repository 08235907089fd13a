//! The one table of enum <-> wire code (u8) mappings. Each line below generates both
//! directions, so the writer and the reader cannot disagree; the generated `match` on the
//! enum is exhaustive (a new variant without a code does not compile) and a repeated code
//! is an unreachable pattern (rejected by `clippy -D warnings` and by the tests below).

use crate::error::{Error, Result};
use crate::params::{Allocation, InputDtype, Metric, PcaMethod, SkeletonDtype};

/// An enum stored as one byte on the wire.
pub trait WireCode: Sized + Copy + 'static {
    /// The byte this value is stored as.
    fn code(self) -> u8;
    /// The value a byte stands for; `Error::Format` names the field for unknown codes.
    fn from_code(code: u8) -> Result<Self>;
    /// Every value, in code order.
    const ALL: &'static [Self];
}

macro_rules! wire_codes {
    ($ty:ident, $what:literal, { $($variant:ident = $code:literal),+ $(,)? }) => {
        impl WireCode for $ty {
            fn code(self) -> u8 {
                match self {
                    $($ty::$variant => $code,)+
                }
            }
            fn from_code(code: u8) -> Result<Self> {
                match code {
                    $($code => Ok($ty::$variant),)+
                    _ => Err(Error::Format(format!(concat!("unknown ", $what, " code {}"), code))),
                }
            }
            const ALL: &'static [Self] = &[$($ty::$variant),+];
        }
    };
}

wire_codes!(InputDtype, "input dtype", { F32 = 0, F16 = 1, Bf16 = 2 });
wire_codes!(SkeletonDtype, "skeleton dtype", { F16 = 0, Bf16 = 1, F32 = 2 });
wire_codes!(Metric, "metric", { Mse = 0, InnerProduct = 1 });
wire_codes!(PcaMethod, "pca method", { Exact = 0, Randomized = 1, None = 2 });
wire_codes!(Allocation, "allocation", { Uniform = 0, Waterfill = 1 });

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: WireCode + PartialEq + std::fmt::Debug>() {
        for (i, &v) in T::ALL.iter().enumerate() {
            assert_eq!(v.code() as usize, i, "{v:?}: codes are dense, in order");
            assert_eq!(T::from_code(v.code()).unwrap(), v);
        }
        let unknown = T::ALL.len() as u8;
        assert!(T::from_code(unknown).unwrap_err().is_format_error());
    }

    #[test]
    fn every_code_round_trips_and_unknown_codes_are_format_errors() {
        check::<InputDtype>();
        check::<SkeletonDtype>();
        check::<Metric>();
        check::<PcaMethod>();
        check::<Allocation>();
        let msg = PcaMethod::from_code(9).unwrap_err().to_string();
        assert!(msg.contains("unknown pca method code 9"), "{msg}");
    }
}
