//! Element sizes of the dtype names that appear in `AllocRequest.dtype`.
//!
//! LMCache sends torch dtype names (`"bfloat16"`, sometimes `"torch.bfloat16"`);
//! other senders use short names (`"bf16"`). Matching ignores ASCII case and an
//! optional `torch.` prefix.

/// Known dtype names and their element size in bytes.
const DTYPES: &[(&str, u64)] = &[
    ("bfloat16", 2),
    ("bf16", 2),
    ("float16", 2),
    ("half", 2),
    ("fp16", 2),
    ("f16", 2),
    ("int16", 2),
    ("short", 2),
    ("uint16", 2),
    ("float32", 4),
    ("float", 4),
    ("fp32", 4),
    ("f32", 4),
    ("int32", 4),
    ("int", 4),
    ("uint32", 4),
    ("float64", 8),
    ("double", 8),
    ("fp64", 8),
    ("f64", 8),
    ("int64", 8),
    ("long", 8),
    ("uint64", 8),
    ("uint8", 1),
    ("int8", 1),
    ("bool", 1),
    ("fp8", 1),
    ("float8_e4m3fn", 1),
    ("float8_e4m3fnuz", 1),
    ("float8_e5m2", 1),
    ("float8_e5m2fnuz", 1),
    ("float8_e8m0fnu", 1),
    ("fp8_e4m3", 1),
    ("fp8_e5m2", 1),
    // LMCache's own names (`lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE`, 0.5.6),
    // which its sender puts in `AllocRequest.dtype`.
    ("fp8_e4m3fn", 1),
    ("fp8_e4m3fnuz", 1),
    ("fp8_e5m2fnuz", 1),
];

/// Size in bytes of one element of `dtype`, or `None` for an unknown name.
///
/// Accepts torch names (`"bfloat16"`, `"float8_e4m3fn"`), the `torch.` prefixed
/// form (`"torch.float16"`) and common short names (`"bf16"`, `"fp32"`, `"fp8"`),
/// ignoring ASCII case.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    let name = strip_prefix_ignore_case(dtype, "torch.").unwrap_or(dtype);
    DTYPES
        .iter()
        .find(|(known, _)| known.eq_ignore_ascii_case(name))
        .map(|&(_, size)| size)
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    if head.eq_ignore_ascii_case(prefix) {
        s.get(prefix.len()..)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_sizes() {
        for (name, size) in [
            ("bfloat16", 2),
            ("bf16", 2),
            ("float16", 2),
            ("half", 2),
            ("fp16", 2),
            ("float32", 4),
            ("float", 4),
            ("fp32", 4),
            ("float64", 8),
            ("uint8", 1),
            ("int8", 1),
            ("float8_e4m3fn", 1),
            ("float8_e5m2", 1),
            ("fp8", 1),
            ("int32", 4),
            ("int64", 8),
        ] {
            assert_eq!(dtype_size(name), Some(size), "{name}");
        }
    }

    /// Every name LMCache 0.5.6's sender writes (`TORCH_DTYPE_TO_STR_DTYPE`).
    #[test]
    fn lmcache_dtype_names() {
        for (name, size) in [
            ("half", 2),
            ("bfloat16", 2),
            ("float", 4),
            ("double", 8),
            ("int8", 1),
            ("uint8", 1),
            ("int16", 2),
            ("int32", 4),
            ("int64", 8),
            ("bool", 1),
            ("fp8_e4m3fn", 1),
            ("fp8_e4m3fnuz", 1),
            ("fp8_e5m2", 1),
            ("fp8_e5m2fnuz", 1),
        ] {
            assert_eq!(dtype_size(name), Some(size), "{name}");
        }
    }

    #[test]
    fn torch_prefix_and_case() {
        assert_eq!(dtype_size("torch.bfloat16"), Some(2));
        assert_eq!(dtype_size("TORCH.Float32"), Some(4));
        assert_eq!(dtype_size("BF16"), Some(2));
        assert_eq!(dtype_size("torch.float8_e4m3fn"), Some(1));
    }

    #[test]
    fn unknown_names() {
        assert_eq!(dtype_size(""), None);
        assert_eq!(dtype_size("torch."), None);
        assert_eq!(dtype_size("bfloat"), None);
        assert_eq!(dtype_size("float128"), None);
        assert_eq!(dtype_size("torch.torch.bf16"), None);
        // Multi-byte UTF-8 must not make the prefix check slice mid-character.
        assert_eq!(dtype_size("tørch.bf16"), None);
        assert_eq!(dtype_size("é"), None);
    }
}
