//! The ggml tensor type table.
//!
//! A GGUF file names each tensor's encoding by a numeric ggml type id. The parser must know the
//! block geometry (elements per block, bytes per block) of *every* type it may meet, supported or
//! not, because that is the only way to bound a tensor's byte range inside the file. Which types
//! the kernels can compute with is a separate, smaller set ([`GgmlType::SUPPORTED`]); asking for
//! compute on anything else is an [`EngineError::UnsupportedTensorType`], raised only at that
//! point so a file with one exotic tensor the engine never touches still loads.

use crate::error::{EngineError, Result};

macro_rules! ggml_types {
    ($( $(#[$m:meta])* $variant:ident = $id:literal, $name:literal, $block:literal, $size:literal; )*) => {
        /// A ggml tensor encoding, with the numeric ids used in GGUF files.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum GgmlType {
            $( $(#[$m])* $variant, )*
        }

        impl GgmlType {
            /// Every type known to the parser, in id order.
            pub const ALL: &'static [GgmlType] = &[$(GgmlType::$variant),*];

            /// Map a GGUF type id to a type; `None` for ids this build does not know.
            pub fn from_id(id: u32) -> Option<Self> {
                match id { $( $id => Some(GgmlType::$variant), )* _ => None }
            }

            /// The GGUF type id.
            pub fn id(self) -> u32 {
                match self { $( GgmlType::$variant => $id, )* }
            }

            /// The name ggml and llama.cpp use, e.g. `"Q4_K"`.
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => $name, )* }
            }

            /// Number of elements in one block.
            pub fn block_size(self) -> usize {
                match self { $( GgmlType::$variant => $block, )* }
            }

            /// Number of bytes in one block.
            pub fn type_size(self) -> usize {
                match self { $( GgmlType::$variant => $size, )* }
            }
        }
    };
}

ggml_types! {
    /// IEEE f32.
    F32 = 0, "F32", 1, 4;
    /// IEEE f16.
    F16 = 1, "F16", 1, 2;
    /// 32 x 4-bit, one f16 scale, offset -8.
    Q4_0 = 2, "Q4_0", 32, 18;
    /// 32 x 4-bit, f16 scale and f16 minimum.
    Q4_1 = 3, "Q4_1", 32, 20;
    /// 32 x 5-bit (low nibbles + a 32-bit mask of fifth bits), one f16 scale, offset -16.
    Q5_0 = 6, "Q5_0", 32, 22;
    Q5_1 = 7, "Q5_1", 32, 24;
    /// 32 x i8, one f16 scale.
    Q8_0 = 8, "Q8_0", 32, 34;
    Q8_1 = 9, "Q8_1", 32, 36;
    Q2_K = 10, "Q2_K", 256, 84;
    Q3_K = 11, "Q3_K", 256, 110;
    /// 256-element super-block of 8 x 32 4-bit sub-blocks with 6-bit scales and minimums.
    Q4_K = 12, "Q4_K", 256, 144;
    Q5_K = 13, "Q5_K", 256, 176;
    /// 256-element super-block of 16 x 16 6-bit sub-blocks with i8 scales.
    Q6_K = 14, "Q6_K", 256, 210;
    Q8_K = 15, "Q8_K", 256, 292;
    IQ2_XXS = 16, "IQ2_XXS", 256, 66;
    IQ2_XS = 17, "IQ2_XS", 256, 74;
    IQ3_XXS = 18, "IQ3_XXS", 256, 98;
    IQ1_S = 19, "IQ1_S", 256, 50;
    IQ4_NL = 20, "IQ4_NL", 32, 18;
    IQ3_S = 21, "IQ3_S", 256, 110;
    IQ2_S = 22, "IQ2_S", 256, 82;
    IQ4_XS = 23, "IQ4_XS", 256, 136;
    I8 = 24, "I8", 1, 1;
    I16 = 25, "I16", 1, 2;
    I32 = 26, "I32", 1, 4;
    I64 = 27, "I64", 1, 8;
    F64 = 28, "F64", 1, 8;
    IQ1_M = 29, "IQ1_M", 256, 56;
    BF16 = 30, "BF16", 1, 2;
    TQ1_0 = 34, "TQ1_0", 256, 54;
    TQ2_0 = 35, "TQ2_0", 256, 66;
    MXFP4 = 39, "MXFP4", 32, 17;
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What an activation vector must be converted to before a dot product with a weight row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActivationKind {
    /// Plain f32 (weights in F32 / F16).
    F32,
    /// 32-element blocks of i8 with an f32 scale (weights in Q4_0 / Q4_1 / Q5_0 / Q8_0).
    Q8x32,
    /// 256-element blocks of i8 with an f32 scale and 16-element partial sums (K-quants).
    Q8K,
}

impl GgmlType {
    /// The types the compute kernels implement.
    pub const SUPPORTED: &'static [GgmlType] = &[
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];

    /// Whether the compute kernels implement this type.
    pub fn is_supported(self) -> bool {
        Self::SUPPORTED.contains(&self)
    }

    /// `"F32, F16, Q8_0, ..."`, for error messages.
    pub fn supported_list() -> String {
        Self::SUPPORTED.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
    }

    /// The activation encoding the dot kernel for this weight type consumes; `None` when the
    /// type is not supported for compute.
    pub fn activation_kind(self) -> Option<ActivationKind> {
        match self {
            GgmlType::F32 | GgmlType::F16 => Some(ActivationKind::F32),
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => Some(ActivationKind::Q8x32),
            GgmlType::Q4_K | GgmlType::Q6_K => Some(ActivationKind::Q8K),
            _ => None,
        }
    }

    /// Bytes needed for `n_elements` elements, or `None` if `n_elements` is not a whole number
    /// of blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if n_elements.checked_rem(block) != Some(0) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size() as u64)
    }

    /// `Ok(())` if supported for compute, else the user-facing error naming `tensor`.
    pub fn require_supported(self, tensor: &str) -> Result<()> {
        if self.is_supported() {
            Ok(())
        } else {
            Err(EngineError::UnsupportedTensorType {
                name: tensor.to_string(),
                ty: self.name().to_string(),
                supported: Self::supported_list(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_sizes_are_sane() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert!(t.block_size() >= 1 && t.type_size() >= 1);
        }
        assert_eq!(GgmlType::from_id(4), None);
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn unsupported_message_lists_supported_types() {
        let err = GgmlType::Q5_K.require_supported("blk.0.ffn_up.weight").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unsupported tensor type Q5_K for tensor `blk.0.ffn_up.weight`; supported: \
             F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K"
        );
    }
}
