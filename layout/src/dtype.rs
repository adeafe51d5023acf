//! Element types of a KV cache.

use std::fmt;
use std::str::FromStr;

use crate::LayoutError;

/// Element type of the cache tensors; only its width matters for byte math, its name
/// matters for compatibility checks (bf16 and fp16 are both 2 bytes but not interchangeable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
    /// Raw bytes (quantized caches with their own packing).
    U8,
}

impl Dtype {
    /// Width of one element in bytes.
    pub const fn width(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 | Dtype::U8 => 1,
        }
    }

    /// The canonical lower-case name (`bf16`, `fp8_e4m3`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::U8 => "u8",
        }
    }

    /// All dtypes, for iteration in tests and CLIs.
    pub const ALL: [Dtype; 6] = [
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::Fp8E4m3,
        Dtype::Fp8E5m2,
        Dtype::U8,
    ];
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let found = match lower.as_str() {
            "f16" | "fp16" | "float16" | "half" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::Bf16,
            "f32" | "fp32" | "float32" | "float" => Dtype::F32,
            "fp8" | "fp8_e4m3" | "e4m3" | "float8_e4m3fn" => Dtype::Fp8E4m3,
            "fp8_e5m2" | "e5m2" | "float8_e5m2" => Dtype::Fp8E5m2,
            "u8" | "uint8" => Dtype::U8,
            _ => {
                return Err(LayoutError::Unsupported(format!(
                    "unknown dtype {s:?} (known: f16, bf16, f32, fp8_e4m3, fp8_e5m2, u8)"
                )));
            }
        };
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(d.name().parse::<Dtype>(), Ok(d));
        }
        assert!("int3".parse::<Dtype>().is_err());
        assert_eq!("BFloat16".parse::<Dtype>(), Ok(Dtype::Bf16));
    }
}
