//! One access of `N` consecutive elements, of `N * size_of::<T>()` bytes (2, 4, 8 or 16): the
//! plain loads and stores every kernel family and the cache-hinted loads of `intrinsics` build
//! on.

#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Align16<A>(A);
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Align8<A>(A);
#[repr(C, align(4))]
#[derive(Clone, Copy)]
struct Align4<A>(A);
#[repr(C, align(2))]
#[derive(Clone, Copy)]
struct Align2<A>(A);

/// Loads `N` consecutive elements with one access of `N * size_of::<T>()` bytes.
///
/// # Safety
/// `p` points at `N` readable `T`, aligned to `N * size_of::<T>()` bytes, which is 2, 4, 8 or
/// 16.
#[inline(always)]
pub unsafe fn load<T: Copy, const N: usize>(p: *const T) -> [T; N] {
    // SAFETY (all arms): the caller promises `N` readable elements aligned to their total size,
    // and the arm is chosen by that size, so the wrapper's size and alignment equal it.
    unsafe {
        match N * size_of::<T>() {
            16 => p.cast::<Align16<[T; N]>>().read().0,
            8 => p.cast::<Align8<[T; N]>>().read().0,
            4 => p.cast::<Align4<[T; N]>>().read().0,
            2 => p.cast::<Align2<[T; N]>>().read().0,
            _ => p.cast::<[T; N]>().read(),
        }
    }
}

/// Stores `N` consecutive elements with one access of `N * size_of::<T>()` bytes.
///
/// # Safety
/// `p` points at `N` writable `T`, aligned to `N * size_of::<T>()` bytes, which is 2, 4, 8 or
/// 16.
#[inline(always)]
pub unsafe fn store<T: Copy, const N: usize>(p: *mut T, v: [T; N]) {
    // SAFETY (all arms): as in `load`, for writes.
    unsafe {
        match N * size_of::<T>() {
            16 => p.cast::<Align16<[T; N]>>().write(Align16(v)),
            8 => p.cast::<Align8<[T; N]>>().write(Align8(v)),
            4 => p.cast::<Align4<[T; N]>>().write(Align4(v)),
            2 => p.cast::<Align2<[T; N]>>().write(Align2(v)),
            _ => p.cast::<[T; N]>().write(v),
        }
    }
}
