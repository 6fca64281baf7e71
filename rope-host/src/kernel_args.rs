//! The host side of the kernel ABI: one struct per kernel family, generated from the parameter
//! lists in `rope-kernels/src/abi.rs` (`rope_kernel_params!`, `fused_kernel_params!`,
//! `table_kernel_params!`), and the one launch every kernel goes through.

use std::ffi::c_void;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, result, sys};

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

            /// Launches `function`, one of this family's entry points, on `stream`.
            ///
            /// # Safety
            /// `function` is an entry point of this family loaded in `ctx`, `stream` a stream
            /// of `ctx`, and the arguments satisfy the entry point's `# Safety` section for
            /// `config`.
            pub(crate) unsafe fn launch(
                mut self,
                ctx: &CudaContext,
                function: &CudaFunction,
                config: LaunchConfig,
                stream: sys::CUstream,
            ) -> Result<()> {
                ctx.bind_to_thread()?;
                let mut params = self.pointers();
                // SAFETY: `params` points at this family's arguments in parameter order, each
                // of the size and alignment of its device type (`host_param_type!`), alive
                // until the call returns (the driver copies them at launch); the rest is the
                // caller's promise.
                unsafe {
                    result::launch_kernel(
                        function.cu_function(),
                        config.grid_dim,
                        config.block_dim,
                        config.shared_mem_bytes,
                        stream,
                        &mut params,
                    )
                }?;
                Ok(())
            }
        }
    };
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
