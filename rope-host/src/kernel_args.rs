//! The host side of the kernel ABI: one struct per kernel family, generated from the parameter
//! lists in `rope-kernels/src/abi.rs` (`rope_kernel_params!`, `fused_kernel_params!`,
//! `table_kernel_params!`), and the one launch every kernel goes through.

use std::ffi::c_void;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, sys};

use crate::device::StreamOverlap;
use crate::error::Result;

/// Defines a struct with one field per parameter of a kernel family, in the entry points'
/// parameter order. It is `#[repr(C)]`, so each field sits at the next offset aligned to its
/// size: the layout of the kernels' parameter space, whose parameters are all scalars. The
/// struct's bytes up to the end of its last field are the buffer `cuLaunchKernel` copies
/// (`CU_LAUNCH_PARAM_BUFFER_POINTER`), in one piece rather than a parameter at a time.
macro_rules! host_args {
    ({ $(#[$doc:meta])* $name:ident } $($param:ident: $kind:ident,)*) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[repr(C)]
        pub(crate) struct $name {
            $(pub(crate) $param: rope_kernels::host_param_type!($kind),)*
        }

        impl $name {
            /// The parameter bytes: up to the end of the last field (no trailing padding).
            const PARAM_BYTES: usize = {
                let mut end = 0;
                $(
                    let field_end = std::mem::offset_of!($name, $param)
                        + size_of::<rope_kernels::host_param_type!($kind)>();
                    if field_end > end {
                        end = field_end;
                    }
                )*
                end
            };

            /// Whether every field sits where the kernels' parameter space puts it: at the next
            /// offset aligned to its size after the one before (what `#[repr(C)]` promises,
            /// checked by a test).
            #[cfg(test)]
            fn has_parameter_layout() -> bool {
                let mut at = 0;
                $(
                    let size = size_of::<rope_kernels::host_param_type!($kind)>();
                    at = usize::next_multiple_of(at, size);
                    if std::mem::offset_of!($name, $param) != at {
                        return false;
                    }
                    at += size;
                )*
                at == Self::PARAM_BYTES
            }

            /// Launches `function`, one of this family's entry points, on `stream`; with
            /// [`StreamOverlap::Programmatic`], with the programmatic stream serialization
            /// attribute.
            ///
            /// # Safety
            /// `function` is an entry point of this family loaded in `ctx`, `stream` a stream
            /// of `ctx`, and the arguments satisfy the entry point's `# Safety` section for
            /// `config`; with [`StreamOverlap::Programmatic`], the function waits for the
            /// previous grid before its first global access (it comes from the sm_90 build).
            pub(crate) unsafe fn launch(
                self,
                ctx: &CudaContext,
                function: &CudaFunction,
                config: LaunchConfig,
                stream: sys::CUstream,
                overlap: StreamOverlap,
            ) -> Result<()> {
                ctx.bind_to_thread()?;
                let mut args = self;
                let buffer = std::ptr::from_mut(&mut args).cast::<c_void>();
                // SAFETY: `args` holds this family's arguments in parameter order, each of its
                // device type (`host_param_type!`: scalars) at the offset the parameter space
                // gives it (`#[repr(C)]`), `PARAM_BYTES` of them, alive until the call returns
                // (the driver copies them at launch); the rest is the caller's promise.
                unsafe { launch_with(function, config, stream, overlap, (buffer, Self::PARAM_BYTES)) }
            }
        }
    };
}

/// Launches `function` with its parameters in `(buffer, len)` through `cuLaunchKernel`, or
/// through `cuLaunchKernelEx` with programmatic stream serialization allowed.
///
/// # Safety
/// As the families' `launch`, with `buffer` holding their `len` parameter bytes; the context
/// that loaded `function` is current on this thread.
unsafe fn launch_with(
    function: &CudaFunction,
    config: LaunchConfig,
    stream: sys::CUstream,
    overlap: StreamOverlap,
    (buffer, mut len): (*mut c_void, usize),
) -> Result<()> {
    // The driver's list of "extra" options: the buffer, its size, the end marker (the option
    // tags are small integers passed as pointers, as `cuda.h` defines them).
    let tag = |t: u32| std::ptr::without_provenance_mut::<c_void>(t as usize);
    let mut extra: [*mut c_void; 5] = [
        tag(sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT),
        buffer,
        tag(sys::CU_LAUNCH_PARAM_BUFFER_SIZE_AS_INT),
        std::ptr::from_mut(&mut len).cast(),
        tag(sys::CU_LAUNCH_PARAM_END_AS_INT),
    ];
    match overlap {
        StreamOverlap::None => {
            let (grid, block) = (config.grid_dim, config.block_dim);
            // SAFETY: `extra` is a terminated option list whose buffer and size live until the
            // call returns; no `kernelParams` beside it; the rest is the caller's promises.
            unsafe {
                sys::cuLaunchKernel(
                    function.cu_function(),
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    config.shared_mem_bytes,
                    stream,
                    std::ptr::null_mut(),
                    extra.as_mut_ptr(),
                )
            }
            .result()?;
        }
        StreamOverlap::Programmatic => {
            // SAFETY: `CUlaunchAttribute` is a plain C struct (an id, padding and a union of
            // integers and handles), valid all zero; then its id and the union's member for
            // that id are set.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            let launch = sys::CUlaunchConfig {
                gridDimX: config.grid_dim.0,
                gridDimY: config.grid_dim.1,
                gridDimZ: config.grid_dim.2,
                blockDimX: config.block_dim.0,
                blockDimY: config.block_dim.1,
                blockDimZ: config.block_dim.2,
                sharedMemBytes: config.shared_mem_bytes,
                hStream: stream,
                attrs: &mut attribute,
                numAttrs: 1,
            };
            // SAFETY: `launch` and `attribute` live until the call returns; the function, the
            // stream and the parameters are the caller's promises, and the function waits for
            // the previous grid as the attribute requires.
            unsafe {
                sys::cuLaunchKernelEx(
                    &launch,
                    function.cu_function(),
                    std::ptr::null_mut(),
                    extra.as_mut_ptr(),
                )
            }
            .result()?;
        }
    }
    Ok(())
}

rope_kernels::plain_kernel_params!(host_args {
    /// The arguments of every RoPE entry point (`rope-kernels/src/rope.rs`), device pointers
    /// as addresses; the fused arguments copy all of them but `sin_sign`.
    RopeArgs
});

rope_kernels::fused_kernel_params!(host_args {
    /// The arguments of every fused entry point (`rope-kernels/src/fused.rs`): the RoPE
    /// arguments, then the fused ones.
    FusedArgs
});

rope_kernels::fused_forms_kernel_params!(host_args {
    /// The arguments of the fused entry points of FlashInfer's forms: the fused arguments, then
    /// the forms' own.
    FusedFormsArgs
});

rope_kernels::nvfp4_kernel_params!(host_args {
    /// The arguments of the fused entry points of NVFP4 caches: the fused arguments, then the
    /// block scales' addresses.
    Nvfp4Args
});

rope_kernels::norm_grad_kernel_params!(host_args {
    /// The arguments of the QK-norm + RoPE backward's gradient entry points
    /// (`rope-kernels/src/fused/grad.rs`): the RoPE arguments, then the backward's.
    NormGradArgs
});

rope_kernels::norm_grad_weights_kernel_params!(host_args {
    /// The arguments of the backward's weights entry points.
    NormGradWeightsArgs
});

rope_kernels::norm_across_kernel_params!(host_args {
    /// The arguments of the across-heads normalisation + RoPE entry points
    /// (`rope-kernels/src/fused/across.rs`): the RoPE arguments, then their own.
    NormAcrossArgs
});

rope_kernels::table_kernel_params!(host_args {
    /// The arguments of the table-building entry point (`rope-kernels/src/table.rs`).
    TableArgs
});

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family's struct is laid out as its kernels' parameter space: each parameter at
    /// the next offset aligned to its size, the buffer ending after the last one.
    #[test]
    fn argument_structs_have_the_parameter_layout() {
        assert!(RopeArgs::has_parameter_layout());
        assert!(FusedArgs::has_parameter_layout());
        assert!(FusedFormsArgs::has_parameter_layout());
        assert!(Nvfp4Args::has_parameter_layout());
        assert!(TableArgs::has_parameter_layout());
        assert!(NormGradArgs::has_parameter_layout());
        assert!(NormGradWeightsArgs::has_parameter_layout());
        assert!(NormAcrossArgs::has_parameter_layout());
        const { assert!(FusedArgs::PARAM_BYTES > RopeArgs::PARAM_BYTES) };
        const { assert!(FusedFormsArgs::PARAM_BYTES > FusedArgs::PARAM_BYTES) };
    }
}
