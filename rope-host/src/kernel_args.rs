//! The host side of the kernel ABI: one struct per kernel family, generated from the parameter
//! lists in `rope-kernels/src/abi.rs` (`rope_kernel_params!`, `fused_kernel_params!`,
//! `table_kernel_params!`), and the one launch every kernel goes through.

use std::ffi::c_void;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, sys};

use crate::device::StreamOverlap;
use crate::error::Result;

/// The kernel parameters of one launch packed as the driver copies them into the kernel's
/// parameter space: each parameter in order, at the next offset aligned to its size (the layout
/// of a kernel whose parameters are scalars, as every entry point's are), at most
/// [`PARAM_BYTES`] bytes. Passed whole (`CU_LAUNCH_PARAM_BUFFER_POINTER`), the driver copies
/// it in one piece instead of reading each parameter through its own pointer.
#[repr(C, align(8))]
struct ParamBuffer {
    bytes: [u8; PARAM_BYTES],
    len: usize,
}

/// Room for the parameters of any family (the fused family's, the largest, take under 600
/// bytes; a family outgrowing it fails its first launch, in every GPU test).
const PARAM_BYTES: usize = 1024;

impl ParamBuffer {
    fn new() -> Self {
        Self {
            bytes: [0; PARAM_BYTES],
            len: 0,
        }
    }

    /// Appends `value` at the next offset aligned to its size.
    fn push<T: bytemuck::Pod>(&mut self, value: T) -> Result<()> {
        let bytes = bytemuck::bytes_of(&value);
        let at = self.len.next_multiple_of(bytes.len());
        let end = at + bytes.len();
        let slot = self.bytes.get_mut(at..end).ok_or_else(|| {
            crate::error::invalid("kernel", "the kernel parameters exceed the driver's limit")
        })?;
        slot.copy_from_slice(bytes);
        self.len = end;
        Ok(())
    }
}

/// Defines a struct with one field per parameter of a kernel family and its packing, in the
/// entry points' parameter order, into the buffer `cuLaunchKernel` takes.
macro_rules! host_args {
    ({ $(#[$doc:meta])* $name:ident } $($param:ident: $kind:ident,)*) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub(crate) struct $name {
            $(pub(crate) $param: rope_kernels::host_param_type!($kind),)*
        }

        impl $name {
            /// Every field packed in the entry points' parameter order.
            fn packed(&self) -> Result<ParamBuffer> {
                let mut buffer = ParamBuffer::new();
                $(buffer.push(self.$param)?;)*
                Ok(buffer)
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
                self,
                ctx: &CudaContext,
                function: &CudaFunction,
                config: LaunchConfig,
                stream: sys::CUstream,
                overlap: StreamOverlap,
            ) -> Result<()> {
                ctx.bind_to_thread()?;
                let mut buffer = self.packed()?;
                // SAFETY: `buffer` holds this family's arguments in parameter order, each of
                // its device type (`host_param_type!`: scalars) at its own alignment, alive
                // until the call returns (the driver copies it at launch); the rest is the
                // caller's promise.
                unsafe { launch_with(function, config, stream, overlap, &mut buffer) }
            }
        }
    };
}

/// Launches `function` with the packed parameters `buffer` through `cuLaunchKernel`, or
/// through `cuLaunchKernelEx` with programmatic stream serialization allowed.
///
/// # Safety
/// As the families' `launch`, with `buffer` their packed parameters; the context that loaded
/// `function` is current on this thread.
unsafe fn launch_with(
    function: &CudaFunction,
    config: LaunchConfig,
    stream: sys::CUstream,
    overlap: StreamOverlap,
    buffer: &mut ParamBuffer,
) -> Result<()> {
    let mut len = buffer.len;
    // The driver's list of "extra" options: the buffer, its size, the end marker (the option
    // tags are small integers passed as pointers, as `cuda.h` defines them).
    let tag = |t: u32| std::ptr::without_provenance_mut::<c_void>(t as usize);
    let mut extra: [*mut c_void; 5] = [
        tag(sys::CU_LAUNCH_PARAM_BUFFER_POINTER_AS_INT),
        buffer.bytes.as_mut_ptr().cast(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each parameter starts at the next offset aligned to its size, as the kernels' parameter
    /// space lays out scalars, and the buffer ends after the last one.
    #[test]
    fn parameters_pack_at_their_alignment() {
        let mut b = ParamBuffer::new();
        b.push(7u32).expect("room");
        b.push(0x1122_3344_5566_7788u64).expect("room");
        b.push(1.5f32).expect("room");
        assert_eq!(b.len, 20);
        assert_eq!(b.bytes[..4], 7u32.to_ne_bytes());
        assert_eq!(b.bytes[4..8], [0; 4]);
        assert_eq!(b.bytes[8..16], 0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(b.bytes[16..20], 1.5f32.to_ne_bytes());
        while b.len + 8 <= PARAM_BYTES {
            b.push(0u64).expect("room");
        }
        assert!(
            b.push(0u64).is_err(),
            "a buffer overflow is an error, not a write"
        );
    }
}
