//! The host side of the kernel ABI: one struct per kernel family, generated from the parameter
//! lists in `kernels-gpu/src/abi.rs` (`rope_kernel_params!`, `table_kernel_params!`), whose
//! `push` appends every field to a launch in the order of the entry points' parameters.

use cudarc::driver::{LaunchArgs, PushKernelArg};

/// Defines a struct with one field per parameter of a kernel family and its `push`.
macro_rules! host_args {
    ({ $(#[$doc:meta])* $name:ident } $($param:ident: $kind:ident,)*) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub(crate) struct $name {
            $(pub(crate) $param: kernels_gpu::host_param_type!($kind),)*
        }

        impl $name {
            /// Appends every argument to `launch`, in the entry points' parameter order.
            pub(crate) fn push<'a>(&'a self, launch: &mut LaunchArgs<'a>) {
                $(launch.arg(&self.$param);)*
            }
        }
    };
}

kernels_gpu::rope_kernel_params!(host_args {
    /// The arguments of every RoPE entry point (`kernels-gpu/src/rope.rs`), device pointers
    /// as addresses.
    RopeArgs
});

kernels_gpu::table_kernel_params!(host_args {
    /// The arguments of every table-building entry point (`kernels-gpu/src/table.rs`).
    TableArgs
});
