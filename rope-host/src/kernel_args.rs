//! The host side of the kernel ABI: one struct per kernel family, generated from the parameter
//! lists in `rope-kernels/src/abi.rs` (`rope_kernel_params!`, `fused_kernel_params!`,
//! `table_kernel_params!`), and the one launch every kernel goes through.

use std::ffi::c_void;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, result, sys};

use crate::device::StreamOverlap;
use crate::error::Result;

/// Defines a struct with one field per parameter of a kernel family, and the array of pointers
/// to its fields, in the entry points' parameter order, that `cuLaunchKernel` takes.
macro_rules! host_args {
    ({ $(#[$doc:meta])* $name:ident } $($param:ident: $kind:ident,)*) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub(crate) struct $name {
            $(pub(crate) $param: rope_kernels::host_param_type!($kind),)*
        }

        impl $name {
            /// Pointers to every field, in the entry points' parameter order.
            fn pointers(&mut self) -> [*mut c_void; [$(stringify!($param)),*].len()] {
                [$(std::ptr::from_mut(&mut self.$param).cast::<c_void>(),)*]
            }

            /// Launches `function`, one of this family's entry points, on `stream`; with
            /// [`StreamOverlap::Programmatic`], with the programmatic stream serialization
            /// attribute.
            ///
            /// # Safety
            /// `function` is an entry point of this family loaded in `ctx`, `stream` a stream
            /// of `ctx`, and the arguments satisfy the entry point's `# Safety` section for
            /// `config`; with [`StreamOverlap::Programmatic`], the function waits for the
            /// previous grid before its first global access (it comes from `PTX_SM90`).
            pub(crate) unsafe fn launch(
                mut self,
                ctx: &CudaContext,
                function: &CudaFunction,
                config: LaunchConfig,
                stream: sys::CUstream,
                overlap: StreamOverlap,
            ) -> Result<()> {
                ctx.bind_to_thread()?;
                let mut params = self.pointers();
                // SAFETY: `params` points at this family's arguments in parameter order, each
                // of the size and alignment of its device type (`host_param_type!`), alive
                // until the call returns (the driver copies them at launch); the rest is the
                // caller's promise.
                unsafe { launch_with(function, config, stream, overlap, &mut params) }
            }
        }
    };
}

/// Launches `function` with the parameter pointers `params` through `cuLaunchKernel`, or
/// through `cuLaunchKernelEx` with programmatic stream serialization allowed.
///
/// # Safety
/// As the families' `launch`, with `params` their parameters' pointers; the context that
/// loaded `function` is current on this thread.
unsafe fn launch_with(
    function: &CudaFunction,
    config: LaunchConfig,
    stream: sys::CUstream,
    overlap: StreamOverlap,
    params: &mut [*mut c_void],
) -> Result<()> {
    match overlap {
        // SAFETY: the caller's promises.
        StreamOverlap::None => unsafe {
            result::launch_kernel(
                function.cu_function(),
                config.grid_dim,
                config.block_dim,
                config.shared_mem_bytes,
                stream,
                params,
            )?
        },
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
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()?;
        }
    }
    Ok(())
}

rope_kernels::rope_kernel_params!(host_args {
    /// The arguments of every RoPE entry point (`rope-kernels/src/rope.rs`), device pointers
    /// as addresses.
    RopeArgs
});

rope_kernels::fused_kernel_params!(host_args {
    /// The arguments of every fused entry point (`rope-kernels/src/fused.rs`): the RoPE
    /// arguments, then the fused ones.
    FusedArgs
});

rope_kernels::table_kernel_params!(host_args {
    /// The arguments of every table-building entry point (`rope-kernels/src/table.rs`).
    TableArgs
});
