//! Builds RoPE cos/sin tables on the GPU with the same arithmetic as the in-kernel sin/cos.
//!
//! # Formula and layout
//! Row `p < rows`, column `i < half`:
//! `cos[p * row_stride + i] = scale * cos(p * inv_freq[i])`,
//! `sin[p * row_stride + i] = scale * sin(p * inv_freq[i])`, computed by
//! [`crate::math::rope_cos_sin_mode`] and rounded once to the element type. Separate tables use
//! `row_stride = half`; vLLM's combined `cos_sin_cache [rows, 2 * half]` uses
//! `sin = cos + half` and `row_stride = 2 * half`.
//!
//! # Thread mapping
//! One thread per `(p, i)`, `rows * half` in all, walked by a grid-stride loop over
//! `blockIdx.x`; consecutive threads write consecutive columns of a row.

use core::num::NonZeroU64;

use crate::abi::for_each_table_kernel;
use crate::elem::{Bf16, Elem, Half};
use crate::intrinsics::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x, trap};
use crate::math;

/// The parameters of every table entry point, as `crate::table_kernel_params!` lists them.
macro_rules! params_struct {
    ({} $($param:ident: $kind:ident,)*) => {
        /// The parameters of every table entry point.
        struct Params<T> {
            $($param: crate::device_param_type!($kind, T),)*
        }
    };
}
crate::table_kernel_params!(params_struct {});

/// The kernel body.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body<T: Elem>(p: Params<T>) {
    let Some(mode) = math::AngleMode::from_u32(p.angle_mode) else {
        trap()
    };
    let half64 = NonZeroU64::from(p.half);
    let total = p.rows * half64.get();
    let step = grid_dim_x() as u64 * block_dim_x() as u64;
    let mut idx = block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64;
    while idx < total {
        let (pos, i) = (idx / half64, idx % half64);
        // SAFETY: i < half, the length of inv_freq; pos < rows and i < half <= row_stride,
        // so the offset is inside the promised `rows` rows.
        unsafe {
            let (c, s) = math::rope_cos_sin_mode(pos as i64, *p.inv_freq.add(i as usize), mode);
            let at = (pos * p.row_stride + i) as usize;
            *p.cos.add(at) = T::from_f32(c * p.scale);
            *p.sin.add(at) = T::from_f32(s * p.scale);
        }
        idx += step;
    }
}

/// Defines one exported table builder per element type.
macro_rules! table_kernel {
    ($($name:ident: $dt:ident, $t:ty;)*) => {$(
        crate::table_kernel_params!(table_entry { $name, $t });
    )*};
}

/// One table builder with the parameter list of [`crate::table_kernel_params!`].
macro_rules! table_entry {
    ({ $name:ident, $t:ty } $($param:ident: $kind:ident,)*) => {
        /// Writes the cos/sin tables of `rows` rows; see the module documentation.
        ///
        /// # Safety
        /// `cos` and `sin` each address `rows` rows of `row_stride >= half` elements, the
        /// `(p, i < half)` elements of `cos` and of `sin` are distinct, and `inv_freq` holds
        /// `half` `f64`.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name($($param: crate::device_param_type!($kind, $t),)*) {
            // SAFETY: the caller's promises are those of `body`.
            unsafe { body::<$t>(Params { $($param,)* }) }
        }
    };
}

for_each_table_kernel!(table_kernel);
