//! Where each kernel's machine code comes from: the embedded cubins wherever one runs on the
//! device (no JIT compilation), the PTX elsewhere or when `ROPE_KERNEL_CODE=ptx` asks for it.

use rope_host::cudarc::driver::sys::CUdevice_attribute::{
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
};
use rope_host::{KERNEL_CODE_VAR, KernelCode, PTX_ARCH_VAR, PtxBuild, compiled_architectures};
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

/// A thread on which the context was never current loads a kernel from a module that another
/// thread loaded (a cubin loads whole, on its first kernel's thread), then every kernel's
/// resources: the occupancy queries bind the context themselves rather than fail with
/// `CUDA_ERROR_INVALID_CONTEXT`.
#[test]
fn kernels_of_modules_another_thread_loaded_load_on_a_fresh_thread() {
    if gpu_or_skip("kernels_of_modules_another_thread_loaded_load_on_a_fresh_thread").is_none() {
        return;
    }
    // A context handle of its own, so that this handle's module cache starts empty whatever
    // the other tests loaded.
    let ctx = rope_host::open_device(0).expect("device");
    let rope = rope_host::Rope::new(ctx.new_stream().expect("stream")).expect("handle");
    // Two kernels of sm_80's build alone, which every device takes from one module.
    let mut sm80_only = rope_kernels::abi::all_symbols()
        .filter(|s| !PtxBuild::Sm89.holds(s) && !PtxBuild::Sm90.holds(s));
    let (first, second) = (
        sm80_only.next().expect("a kernel"),
        sm80_only.next().expect("another"),
    );
    rope.kernel_code(first).expect("loads on this thread");
    let (code, resources) =
        std::thread::spawn(move || (rope.kernel_code(second), rope.resources()))
            .join()
            .expect("the thread ends");
    code.expect("a kernel of the loaded module loads on a fresh thread");
    let resources = resources.expect("every kernel loads on a fresh thread");
    assert_eq!(resources.len(), rope_kernels::abi::all_symbols().count());
}
