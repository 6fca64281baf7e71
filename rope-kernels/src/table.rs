//! Builds RoPE cos/sin tables on the GPU with the same arithmetic as the in-kernel sin/cos.
//!
//! # Formula and layout
//! Row `p < rows`, column `i < half`:
//! `cos[p * row_stride + i] = scale * cos(p * inv_freq[i])`,
//! `sin[p * row_stride + i] = scale * sin(p * inv_freq[i])`, computed by
//! [`crate::math::rope_cos_sin_mode`] and rounded once to the element type. Separate tables use
//! `row_stride = half`; vLLM's combined `cos_sin_cache [rows, 2 * half]` uses
//! `sin = cos + half` and `row_stride = 2 * half`. One kernel writes every element type, the
//! `dtype` argument's (a uniform branch around the stores).
//!
//! # Thread mapping
//! One thread per `(p, i)`, `rows * half` in all, walked by a grid-stride loop over
//! `blockIdx.x`; consecutive threads write consecutive columns of a row.

use core::num::NonZeroU64;

use crate::abi::DType;
use crate::elem::{Bf16, Elem, Half};
use crate::intrinsics::{block_dim_x, block_idx_x, grid_dim_x, thread_idx_x, trap};
use crate::math;

/// The parameters of every table entry point, as `crate::table_kernel_params!` lists them.
macro_rules! params_struct {
    ({} $($param:ident: $kind:ident,)*) => {
        /// The parameters of the table entry point.
        struct Params {
            $($param: crate::device_param_type!($kind, u8),)*
        }
    };
}
crate::table_kernel_params!(params_struct {});

/// The kernel body for tables of `T`.
///
/// # Safety
/// The promises of the entry point, with tables of `T`.
#[inline(always)]
unsafe fn body<T: Elem>(p: &Params) {
    let Some(mode) = math::AngleMode::from_u32(p.angle_mode) else {
        trap()
    };
    let (cos, sin) = (p.cos.cast::<T>(), p.sin.cast::<T>());
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
            *cos.add(at) = T::from_f32(c * p.scale);
            *sin.add(at) = T::from_f32(s * p.scale);
        }
        idx += step;
    }
}

/// The table builder with the parameter list of [`crate::table_kernel_params!`].
macro_rules! table_entry {
    ({} $($param:ident: $kind:ident,)*) => {
        /// Writes the cos/sin tables of `rows` rows of `dtype`; see the module documentation.
        ///
        /// # Safety
        /// `cos` and `sin` each address `rows` rows of `row_stride >= half` elements of
        /// `dtype`, the `(p, i < half)` elements of `cos` and of `sin` are distinct, and
        /// `inv_freq` holds `half` `f64`.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn rope_table(
            $($param: crate::device_param_type!($kind, u8),)*
        ) {
            let p = Params { $($param,)* };
            // SAFETY: the caller's promises, for tables of the element type `dtype` names,
            // are those of `body`.
            unsafe {
                match p.dtype {
                    d if d == DType::F32 as u32 => body::<f32>(&p),
                    d if d == DType::F16 as u32 => body::<Half>(&p),
                    d if d == DType::BF16 as u32 => body::<Bf16>(&p),
                    _ => trap(),
                }
            }
        }
    };
}
crate::table_kernel_params!(table_entry {});
