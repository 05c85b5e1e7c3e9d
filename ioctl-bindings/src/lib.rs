//! Raw NVIDIA resource-manager (RM) ioctl ABI as Valve uses it: `#[repr(C)]` argument structs,
//! request numbers, class and control ids, status codes and typed object handles. No behaviour.
//!
//! The layouts are those of NVIDIA's open kernel module, stable across the 525-595 branches.
//! Every struct has a size and field-offset test next to its definition. The safe wrappers that
//! issue these ioctls live in the `valve` crate (`ctl/valve`).

pub mod classes;
pub mod controls;
pub mod escape;
pub mod handles;
pub mod status;
pub mod structs;

pub use classes::*;
pub use controls::*;
pub use escape::*;
pub use handles::*;
pub use status::*;
pub use structs::*;

/// Asserts a struct's size and the byte offset of each named field (used by the layout tests).
#[cfg(test)]
#[macro_export]
macro_rules! assert_layout {
    ($ty:ty, size = $size:expr $(, $field:ident @ $off:expr)* $(,)?) => {{
        assert_eq!(::std::mem::size_of::<$ty>(), $size, "size of {}", stringify!($ty));
        $(
            assert_eq!(
                ::std::mem::offset_of!($ty, $field),
                $off,
                "offset of {}.{}",
                stringify!($ty),
                stringify!($field)
            );
        )*
    }};
}
