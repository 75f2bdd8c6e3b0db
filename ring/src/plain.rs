//! The [`Plain`] marker trait for ring entries.

/// Marker for plain-data ring entries: any bit pattern is a valid value and
/// the value holds no pointers.
///
/// Ring slots are zero-filled at construction and may be read back with any
/// bytes another process (or an unwritten reserved slot) left there, so the
/// ring relies on this contract to stay free of undefined behaviour.
///
/// # Safety
///
/// Implement this only for types where:
/// - every bit pattern of `size_of::<Self>()` bytes is a valid value (so not
///   `bool`, `char`, enums, references, `NonZero*`, ...);
/// - the value holds no pointers or references (they would be meaningless in
///   another process that maps the same ring);
/// - for `#[repr(C)]` structs, every field is itself `Plain`.
///
/// ```
/// use kvferry_ring::Plain;
/// #[derive(Clone, Copy)]
/// #[repr(C)]
/// struct Desc { slot: u32, len: u32, offset: u64 }
/// // SAFETY: repr(C) struct of integers, no padding, no pointers.
/// unsafe impl Plain for Desc {}
/// ```
pub unsafe trait Plain: Copy + Send + 'static {}

macro_rules! impl_plain {
    ($($t:ty),* $(,)?) => {
        $(
            // SAFETY: every bit pattern of this integer or float type is a
            // valid value, and it holds no pointer.
            unsafe impl Plain for $t {}
        )*
    };
}

impl_plain!(u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64);

// SAFETY: an array's bytes are exactly those of its N elements (no padding
// between elements), each of which accepts any bit pattern and holds no pointer.
unsafe impl<T: Plain, const N: usize> Plain for [T; N] {}
