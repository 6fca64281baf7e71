//! Where each kernel's machine code comes from: the embedded cubins wherever one runs on the
//! device (no JIT compilation), the PTX elsewhere or when `ROPE_KERNEL_CODE=ptx` asks for it.

use rope_host::cudarc::driver::sys::CUdevice_attribute::{
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
};
use rope_host::{KERNEL_CODE_VAR, KernelCode, PTX_ARCH_VAR, compiled_architectures};
use rope_tests::gpu::gpu_or_skip;

/// With cubins for this device's architecture embedded (and neither variable set), every
/// kernel comes from a cubin of the device's major version and at most its minor version;
/// without them, or with `ROPE_KERNEL_CODE=ptx`, a kernel comes from the PTX.
#[test]
fn kernels_come_from_the_cubins_that_run_on_the_device_else_from_the_ptx() {
    let Some((stream, rope)) =
        gpu_or_skip("kernels_come_from_the_cubins_that_run_on_the_device_else_from_the_ptx")
    else {
        return;
    };
    let ctx = stream.context();
    let (major, minor) = (
        ctx.attribute(MAJOR).expect("major") as u32,
        ctx.attribute(MINOR).expect("minor") as u32,
    );
    let runs_here = compiled_architectures()
        .into_iter()
        .filter(|a| a / 10 == major && a % 10 <= minor)
        .max();
    let forced_ptx = std::env::var(KERNEL_CODE_VAR).is_ok_and(|v| v == "ptx");
    let capped = std::env::var(PTX_ARCH_VAR).is_ok();
    eprintln!(
        "sm_{major}{minor}: embedded cubins {:?}, {KERNEL_CODE_VAR}={forced_ptx}, {PTX_ARCH_VAR} set: {capped}",
        compiled_architectures()
    );
    match runs_here {
        Some(_) if !forced_ptx && !capped => {
            // Every kernel (the cubins load whole, so this compiles nothing).
            for r in rope.resources().expect("every kernel loads") {
                match r.code {
                    KernelCode::Sass { arch } => assert!(
                        arch / 10 == major && arch % 10 <= minor,
                        "{}: sm_{arch} on sm_{major}{minor}",
                        r.name
                    ),
                    KernelCode::Ptx => panic!("{} came from the PTX", r.name),
                }
            }
        }
        _ if !capped => {
            let symbol = rope_kernels::abi::all_symbols().next().expect("a kernel");
            assert_eq!(rope.kernel_code(symbol).expect("loads"), KernelCode::Ptx);
        }
        _ => {}
    }
    assert!(rope.kernel_code("rope_no_such_kernel").is_err());
}
