//! DLPack's C exchange API (DLPack 1.3, `__dlpack_c_exchange_api__`): a producer's type holds
//! a capsule named `"dlpack_exchange_api"` pointing to a static [`DLPackExchangeAPI`], a table of
//! C functions that describe the producer's tensors and name its current stream without a
//! Python call. rope_rs uses two of them: [`DLPackExchangeAPI::dltensor_from_py_object_no_sync`]
//! to read a tensor (into the same [`Dense`](crate::dlpack::Dense) as the `__dlpack__` path,
//! through the same [`dlpack::read`](crate::dlpack::read)), and
//! [`DLPackExchangeAPI::current_work_stream`] for the stream to launch on.
//!
//! The structures are declared from `dlpack.h` of DLPack 1.3 (`DLPACK_MAJOR_VERSION 1`,
//! `DLPACK_MINOR_VERSION 3`), field for field; a table is used only when its header's major
//! version is [`MAJOR`] (walking `prev_api` to an older table otherwise), see [`usable`].
//! The pure part (layouts, the version gate, the calls) is tested by `cargo test` with a fake
//! producer written in Rust; behind the feature `python`, `types` finds and caches the table
//! of each Python type.

use std::ffi::{c_char, c_int, c_void};

use crate::dlpack::{DL_CUDA, DLDevice, DLTensor};

/// The DLPack major version these declarations mirror (`DLPACK_MAJOR_VERSION` of the header).
pub const MAJOR: u32 = 1;

/// The capsule name of `__dlpack_c_exchange_api__`.
pub const CAPSULE_NAME: &std::ffi::CStr = c"dlpack_exchange_api";

/// The attribute of the producer's type that holds the capsule.
pub const ATTRIBUTE: &str = "__dlpack_c_exchange_api__";

/// `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    /// `major`: a different major version means a different layout.
    pub major: u32,
    /// `minor`: additions only (new enumeration values).
    pub minor: u32,
}

/// `DLManagedTensorVersioned` (only named by the signatures rope_rs does not call).
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// `version`.
    pub version: DLPackVersion,
    /// `manager_ctx`.
    pub manager_ctx: *mut c_void,
    /// `deleter`.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `flags`.
    pub flags: u64,
    /// `dl_tensor`.
    pub dl_tensor: DLTensor,
}

/// `void (*SetError)(void* error_ctx, const char* kind, const char* message)`.
pub type SetError = Option<unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char)>;

/// `DLPackManagedTensorAllocator`.
pub type ManagedTensorAllocator = Option<
    unsafe extern "C" fn(
        *mut DLTensor,
        *mut *mut DLManagedTensorVersioned,
        *mut c_void,
        SetError,
    ) -> c_int,
>;

/// `DLPackManagedTensorFromPyObjectNoSync`: `(void* py_object, DLManagedTensorVersioned** out)`.
pub type ManagedTensorFromPyObjectNoSync =
    Option<unsafe extern "C" fn(*mut c_void, *mut *mut DLManagedTensorVersioned) -> c_int>;

/// `DLPackManagedTensorToPyObjectNoSync`: `(DLManagedTensorVersioned* tensor, void** out)`.
pub type ManagedTensorToPyObjectNoSync =
    Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned, *mut *mut c_void) -> c_int>;

/// `DLPackDLTensorFromPyObjectNoSync`: `(void* py_object, DLTensor* out)`, 0 on success, -1
/// with a Python exception set on failure. Fills a caller-owned `DLTensor` whose `shape` and
/// `strides` the producer keeps; valid until control returns to the producer.
pub type DLTensorFromPyObjectNoSync =
    Option<unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int>;

/// `DLPackCurrentWorkStream`: `(DLDeviceType device_type, int32_t device_id, void** out)`, 0
/// on success, -1 with a Python exception set. `DLDeviceType` is an `int`-sized C enum.
pub type CurrentWorkStream = Option<unsafe extern "C" fn(i32, i32, *mut *mut c_void) -> c_int>;

/// `DLPackExchangeAPIHeader`: stable across versions.
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPIHeader {
    /// The version of the table this header starts.
    pub version: DLPackVersion,
    /// An older table of the same producer, or null.
    pub prev_api: *mut DLPackExchangeAPIHeader,
}

/// `DLPackExchangeAPI`: the table `__dlpack_c_exchange_api__` points to, static in the
/// producer (alive for the whole process).
#[repr(C)]
#[derive(Debug)]
pub struct DLPackExchangeAPI {
    /// `header`.
    pub header: DLPackExchangeAPIHeader,
    /// `managed_tensor_allocator` (never null by the header; unused here).
    pub managed_tensor_allocator: ManagedTensorAllocator,
    /// `managed_tensor_from_py_object_no_sync` (never null; unused here).
    pub managed_tensor_from_py_object_no_sync: ManagedTensorFromPyObjectNoSync,
    /// `managed_tensor_to_py_object_no_sync` (never null; unused here).
    pub managed_tensor_to_py_object_no_sync: ManagedTensorToPyObjectNoSync,
    /// `dltensor_from_py_object_no_sync`: may be null.
    pub dltensor_from_py_object_no_sync: DLTensorFromPyObjectNoSync,
    /// `current_work_stream` (never null by the header; checked anyway).
    pub current_work_stream: CurrentWorkStream,
}

/// How many `prev_api` links [`usable`] follows before giving up (a guard against a cycle).
const MAX_CHAIN: usize = 16;

/// The table of major version [`MAJOR`] that `header` starts or links to through `prev_api`,
/// if it offers `dltensor_from_py_object_no_sync` and `current_work_stream`; `None` (use
/// `__dlpack__`) otherwise.
///
/// # Safety
/// `header` is null or points to a `DLPackExchangeAPIHeader` that, like every header its
/// `prev_api` chain reaches, stays valid for `'a`, and a header of major version [`MAJOR`] starts
/// a `DLPackExchangeAPI` (what a producer's `"dlpack_exchange_api"` capsule promises: the
/// table is static in the producer).
pub unsafe fn usable<'a>(header: *const DLPackExchangeAPIHeader) -> Option<&'a DLPackExchangeAPI> {
    let mut at = header;
    for _ in 0..MAX_CHAIN {
        // SAFETY: `at` is null or a header of the chain, valid for `'a` (the caller's promise).
        let h = unsafe { at.as_ref() }?;
        if h.version.major == MAJOR {
            // SAFETY: a header of major version MAJOR starts a `DLPackExchangeAPI` of this
            // layout (the caller's promise), valid for `'a`.
            let api = unsafe { &*at.cast::<DLPackExchangeAPI>() };
            return (api.dltensor_from_py_object_no_sync.is_some()
                && api.current_work_stream.is_some())
            .then_some(api);
        }
        at = h.prev_api;
    }
    None
}

/// An empty `DLTensor` for the producer to fill.
pub fn empty_dltensor() -> DLTensor {
    DLTensor {
        data: std::ptr::null_mut(),
        device: DLDevice {
            device_type: 0,
            device_id: 0,
        },
        ndim: 0,
        dtype: crate::dlpack::DLDataType {
            code: 0,
            bits: 0,
            lanes: 0,
        },
        shape: std::ptr::null_mut(),
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

impl DLPackExchangeAPI {
    /// The producer's description of `obj` (non-owning): `Some` when it succeeded, `None` when
    /// it failed (with a Python exception set, for the caller to clear) or is missing.
    ///
    /// # Safety
    /// `obj` is a live object of the type this table came from (a `PyObject*`), and the caller
    /// holds what the producer needs to run (the GIL). The returned tensor's `shape`, `strides`
    /// and `data` stay valid only while `obj` is alive and unchanged.
    pub unsafe fn dltensor(&self, obj: *mut c_void) -> Option<DLTensor> {
        let f = self.dltensor_from_py_object_no_sync?;
        let mut out = empty_dltensor();
        // SAFETY: `f` is the producer's `DLPackDLTensorFromPyObjectNoSync` (the table's
        // promise); `obj` is an object of its type (the caller's promise); `out` is a writable
        // `DLTensor` that outlives the call.
        let rc = unsafe { f(obj, &mut out) };
        (rc == 0).then_some(out)
    }

    /// The producer's current work stream on CUDA device `device_id` (`CUstream` as an int, 0
    /// for the legacy default stream): `None` when the call failed (with a Python exception
    /// set, for the caller to clear) or is missing.
    ///
    /// # Safety
    /// The caller holds what the producer needs to run (the GIL).
    pub unsafe fn current_cuda_stream(&self, device_id: i32) -> Option<u64> {
        let f = self.current_work_stream?;
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: `f` is the producer's `DLPackCurrentWorkStream` (the table's promise);
        // `stream` is a writable `void*` that outlives the call.
        let rc = unsafe { f(DL_CUDA, device_id, &mut stream) };
        (rc == 0).then_some(stream as u64)
    }
}

/// Finding, caching and switching off the exchange API of Python types.
#[cfg(feature = "python")]
pub(crate) mod types {
    use std::cell::Cell;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

    use pyo3::prelude::*;
    use pyo3::types::PyType;

    use super::{ATTRIBUTE, CAPSULE_NAME, DLPackExchangeAPI, DLPackExchangeAPIHeader, usable};

    /// The environment variable that, set to anything but `""` or `"0"`, turns the exchange
    /// API off (every tensor then goes through `__dlpack__`).
    pub const DISABLE_VAR: &str = "ROPE_RS_NO_DLPACK_C_API";

    /// 0: not read yet; 1: on; 2: off.
    static ENABLED: AtomicU8 = AtomicU8::new(0);

    /// Tensors borrowed through the exchange API since the process started (for tests).
    static FAST_BORROWS: AtomicU64 = AtomicU64::new(0);

    /// Types whose tables were looked up: each type kept alive (so its address cannot name
    /// another type later) with the address of its usable table, or 0.
    static CACHE: Mutex<Vec<(usize, Py<PyType>, usize)>> = Mutex::new(Vec::new());

    /// How many types [`CACHE`] remembers; others are looked up at each call.
    const CACHE_LIMIT: usize = 64;

    /// Whether the exchange API is used (the environment variable [`DISABLE_VAR`], read once,
    /// or [`set_enabled`]).
    pub fn enabled() -> bool {
        match ENABLED.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let off = std::env::var_os(DISABLE_VAR).is_some_and(|v| !v.is_empty() && v != "0");
                ENABLED.store(if off { 2 } else { 1 }, Ordering::Relaxed);
                !off
            }
        }
    }

    /// Turns the exchange API on or off; returns whether it was on.
    pub fn set_enabled(on: bool) -> bool {
        let was = enabled();
        ENABLED.store(if on { 1 } else { 2 }, Ordering::Relaxed);
        was
    }

    /// Counts one tensor borrowed through the exchange API.
    pub fn count_fast_borrow() {
        FAST_BORROWS.fetch_add(1, Ordering::Relaxed);
    }

    /// Tensors borrowed through the exchange API so far.
    pub fn fast_borrows() -> u64 {
        FAST_BORROWS.load(Ordering::Relaxed)
    }

    thread_local! {
        /// The type and table of this thread's last [`api_of`] answered from [`CACHE`] (whose
        /// types live as long as the process, so the address names the same type): a launch
        /// reads up to a dozen tensors of one type, and this spares the lock for all but the
        /// first.
        static LAST: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    }

    /// The usable exchange table of `obj`'s type, if it has one and the API is enabled.
    pub fn api_of(obj: &Bound<'_, PyAny>) -> Option<&'static DLPackExchangeAPI> {
        if !enabled() {
            return None;
        }
        let key = obj.get_type_ptr() as usize;
        let (last, last_api) = LAST.with(Cell::get);
        if last == key {
            return table(last_api);
        }
        if let Ok(cache) = CACHE.lock()
            && let Some(&(_, _, api)) = cache.iter().find(|(k, _, _)| *k == key)
        {
            LAST.with(|l| l.set((key, api)));
            return table(api);
        }
        // Looked up outside the lock: the attribute lookup may run Python code.
        let ty = obj.get_type();
        let api = lookup(&ty);
        if let Ok(mut cache) = CACHE.lock()
            && cache.len() < CACHE_LIMIT
            && !cache.iter().any(|(k, _, _)| *k == key)
        {
            cache.push((key, ty.unbind(), api));
            LAST.with(|l| l.set((key, api)));
        }
        table(api)
    }

    /// The table at address `api` (0: none).
    fn table(api: usize) -> Option<&'static DLPackExchangeAPI> {
        // SAFETY: a non-zero `api` was returned by `usable` for a producer's capsule: a
        // `DLPackExchangeAPI` that the producer keeps for the whole process (DLPack requires the
        // table to be static).
        unsafe { (api as *const DLPackExchangeAPI).as_ref() }
    }

    /// The producer's current work stream on the CUDA device of `obj` (a `CUstream` as an int,
    /// 0 for the legacy default stream), by its type's exchange API: `None` when the API is off
    /// or missing, `obj` is not a CUDA tensor, or the producer failed (its error cleared).
    pub fn current_stream(obj: &Bound<'_, PyAny>) -> Option<u64> {
        let api = api_of(obj)?;
        // SAFETY: `obj` is a live object (we hold a reference) of the type whose table `api`
        // is, and we hold the GIL; only the device is read from the result.
        let t = unsafe { api.dltensor(obj.as_ptr().cast()) };
        let stream = match t {
            Some(t) if t.device.device_type == super::DL_CUDA => {
                // SAFETY: we hold the GIL.
                unsafe { api.current_cuda_stream(t.device.device_id) }
            }
            Some(_) => return None,
            None => None,
        };
        if stream.is_none() {
            let _ = PyErr::take(obj.py());
        }
        stream
    }

    /// The address of the usable table of `ty`'s `__dlpack_c_exchange_api__`, or 0 (a type
    /// without one, with something other than a `"dlpack_exchange_api"` capsule, or with a
    /// table of another major version). Errors are cleared: the caller falls back to
    /// `__dlpack__`.
    fn lookup(ty: &Bound<'_, PyType>) -> usize {
        let py = ty.py();
        let Ok(capsule) = ty.getattr(pyo3::intern!(py, ATTRIBUTE)) else {
            return 0;
        };
        // SAFETY: `capsule` is a live Python object (we hold a reference); `PyCapsule_GetPointer`
        // checks that it is a capsule named "dlpack_exchange_api" and returns null with an
        // exception set otherwise.
        let header =
            unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_NAME.as_ptr()) }
                as *const DLPackExchangeAPIHeader;
        if header.is_null() {
            let _ = PyErr::take(py);
            return 0;
        }
        // SAFETY: a "dlpack_exchange_api" capsule points to the producer's static
        // `DLPackExchangeAPI`, which starts with its header and lives for the whole process
        // (dlpack.h: "The DLPackExchangeAPI* must stay alive throughout the lifetime of the
        // process"), as do the older tables its `prev_api` chain links.
        unsafe { usable::<'static>(header) }.map_or(0, |api| std::ptr::from_ref(api) as usize)
    }
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of, size_of};

    use super::*;
    use crate::dlpack::{self, DLDataType, Elem};

    /// Offsets and sizes as dlpack.h lays them out for a 64-bit target (pointers of 8 bytes).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn structures_have_the_headers_layout() {
        assert_eq!(size_of::<DLPackVersion>(), 8);
        assert_eq!(offset_of!(DLPackVersion, minor), 4);
        assert_eq!(size_of::<DLPackExchangeAPIHeader>(), 16);
        assert_eq!(offset_of!(DLPackExchangeAPIHeader, version), 0);
        assert_eq!(offset_of!(DLPackExchangeAPIHeader, prev_api), 8);
        assert_eq!(size_of::<DLPackExchangeAPI>(), 56);
        assert_eq!(align_of::<DLPackExchangeAPI>(), 8);
        assert_eq!(offset_of!(DLPackExchangeAPI, header), 0);
        assert_eq!(offset_of!(DLPackExchangeAPI, managed_tensor_allocator), 16);
        assert_eq!(
            offset_of!(DLPackExchangeAPI, managed_tensor_from_py_object_no_sync),
            24
        );
        assert_eq!(
            offset_of!(DLPackExchangeAPI, managed_tensor_to_py_object_no_sync),
            32
        );
        assert_eq!(
            offset_of!(DLPackExchangeAPI, dltensor_from_py_object_no_sync),
            40
        );
        assert_eq!(offset_of!(DLPackExchangeAPI, current_work_stream), 48);
        // The DLTensor the producer fills, and the versioned managed tensor.
        assert_eq!(size_of::<DLTensor>(), 48);
        assert_eq!(offset_of!(DLTensor, device), 8);
        assert_eq!(offset_of!(DLTensor, ndim), 16);
        assert_eq!(offset_of!(DLTensor, dtype), 20);
        assert_eq!(offset_of!(DLTensor, shape), 24);
        assert_eq!(offset_of!(DLTensor, strides), 32);
        assert_eq!(offset_of!(DLTensor, byte_offset), 40);
        assert_eq!(size_of::<DLManagedTensorVersioned>(), 80);
        assert_eq!(offset_of!(DLManagedTensorVersioned, manager_ctx), 8);
        assert_eq!(offset_of!(DLManagedTensorVersioned, deleter), 16);
        assert_eq!(offset_of!(DLManagedTensorVersioned, flags), 24);
        assert_eq!(offset_of!(DLManagedTensorVersioned, dl_tensor), 32);
        // Null function pointers are `None`, so a missing function reads as one.
        assert_eq!(size_of::<DLTensorFromPyObjectNoSync>(), size_of::<usize>());
    }

    /// A fake producer's tensor: `[6, 4, 8]` bfloat16 with strides `[64, 8, 1]` (q of a fused
    /// QKV) on CUDA device 1, behind the `py_object` pointer.
    struct FakeTensor {
        shape: [i64; 3],
        strides: [i64; 3],
    }

    /// The fake `dltensor_from_py_object_no_sync`: describes a [`FakeTensor`], or fails for a
    /// null object.
    unsafe extern "C" fn fake_dltensor(obj: *mut c_void, out: *mut DLTensor) -> c_int {
        if obj.is_null() {
            return -1;
        }
        let t = obj.cast::<FakeTensor>();
        // SAFETY: the tests pass a live `FakeTensor` and a writable `DLTensor`.
        unsafe {
            *out = DLTensor {
                data: 0x7000 as *mut c_void,
                device: DLDevice {
                    device_type: DL_CUDA,
                    device_id: 1,
                },
                ndim: 3,
                dtype: DLDataType {
                    code: 4,
                    bits: 16,
                    lanes: 1,
                },
                shape: (*t).shape.as_mut_ptr(),
                strides: (*t).strides.as_mut_ptr(),
                byte_offset: 16,
            };
        }
        0
    }

    /// The fake `current_work_stream`: stream `0x5000 + device_id` on CUDA, failure elsewhere.
    unsafe extern "C" fn fake_stream(
        device_type: i32,
        device_id: i32,
        out: *mut *mut c_void,
    ) -> c_int {
        if device_type != DL_CUDA {
            return -1;
        }
        // SAFETY: the caller passes a writable `void*`.
        unsafe { *out = (0x5000 + device_id as usize) as *mut c_void };
        0
    }

    fn fake_api(major: u32, prev: *mut DLPackExchangeAPIHeader) -> DLPackExchangeAPI {
        DLPackExchangeAPI {
            header: DLPackExchangeAPIHeader {
                version: DLPackVersion { major, minor: 3 },
                prev_api: prev,
            },
            managed_tensor_allocator: None,
            managed_tensor_from_py_object_no_sync: None,
            managed_tensor_to_py_object_no_sync: None,
            dltensor_from_py_object_no_sync: Some(fake_dltensor),
            current_work_stream: Some(fake_stream),
        }
    }

    fn usable_of(api: &DLPackExchangeAPI) -> Option<&DLPackExchangeAPI> {
        // SAFETY: `api` and the chain it links are live tables of this layout (the tests'
        // own), valid for the borrow.
        unsafe { usable(&api.header) }
    }

    mod version_gate {
        use super::*;

        #[test]
        fn the_mirrored_major_version_is_used() {
            let api = fake_api(MAJOR, std::ptr::null_mut());
            assert!(std::ptr::eq(usable_of(&api).expect("usable"), &api));
            let mut newer_minor = fake_api(MAJOR, std::ptr::null_mut());
            newer_minor.header.version.minor = 99;
            assert!(usable_of(&newer_minor).is_some());
        }

        #[test]
        fn other_major_versions_fall_back() {
            assert!(usable_of(&fake_api(MAJOR + 1, std::ptr::null_mut())).is_none());
            assert!(usable_of(&fake_api(0, std::ptr::null_mut())).is_none());
            // SAFETY: null is allowed.
            assert!(unsafe { usable(std::ptr::null()) }.is_none());
        }

        #[test]
        fn a_newer_table_links_to_the_mirrored_one() {
            let mut old = fake_api(MAJOR, std::ptr::null_mut());
            let new = fake_api(MAJOR + 1, &mut old.header);
            assert!(std::ptr::eq(usable_of(&new).expect("usable"), &old));
        }

        #[test]
        fn a_cycle_of_other_versions_ends() {
            let mut pair = [
                fake_api(MAJOR + 1, std::ptr::null_mut()),
                fake_api(MAJOR + 2, std::ptr::null_mut()),
            ];
            let p = pair.as_mut_ptr();
            // SAFETY: `p` and `p + 1` are the two live tables of `pair`; links and reads go
            // through `p` only while `pair` is alive.
            let found = unsafe {
                (*p).header.prev_api = &raw mut (*p.add(1)).header;
                (*p.add(1)).header.prev_api = &raw mut (*p).header;
                usable(&raw const (*p).header)
            };
            assert!(found.is_none());
        }

        #[test]
        fn tables_without_the_functions_used_fall_back() {
            let mut api = fake_api(MAJOR, std::ptr::null_mut());
            api.dltensor_from_py_object_no_sync = None;
            assert!(usable_of(&api).is_none());
            let mut api = fake_api(MAJOR, std::ptr::null_mut());
            api.current_work_stream = None;
            assert!(usable_of(&api).is_none());
        }
    }

    mod calls {
        use super::*;

        #[test]
        fn the_producers_tensor_reads_as_the_capsule_path_reads_it() {
            let api = fake_api(MAJOR, std::ptr::null_mut());
            let mut t = FakeTensor {
                shape: [6, 4, 8],
                strides: [64, 8, 1],
            };
            // SAFETY: `t` is what `fake_dltensor` expects, alive for the call and the read.
            let dl = unsafe { api.dltensor(std::ptr::from_mut(&mut t).cast()) }.expect("filled");
            // SAFETY: `dl` points into `t`, alive here.
            let d = unsafe { dlpack::read(&dl, "q") }.expect("valid");
            assert_eq!(
                d,
                dlpack::Dense {
                    ptr: 0x7010,
                    elem: Elem::BF16,
                    shape: dlpack::Dims::from_slice(&[6, 4, 8]).expect("3 dims"),
                    strides: dlpack::Dims::from_slice(&[64, 8, 1]).expect("3 dims"),
                    device_id: 1,
                }
            );
            let raw = dlpack::rope_tensor(&d, None, "q").expect("valid");
            assert_eq!(raw.buf.len, 5 * 64 + 3 * 8 + 8);
        }

        #[test]
        fn the_checks_are_the_capsule_paths() {
            let api = fake_api(MAJOR, std::ptr::null_mut());
            let mut t = FakeTensor {
                shape: [6, 4, 8],
                strides: [-64, 8, 1],
            };
            // SAFETY: as above.
            let dl = unsafe { api.dltensor(std::ptr::from_mut(&mut t).cast()) }.expect("filled");
            // SAFETY: `dl` points into `t`, alive here.
            let e = unsafe { dlpack::read(&dl, "k") }.expect_err("negative stride");
            assert_eq!(
                e,
                dlpack::ArgError::Value("k has a negative stride -64 (strides [-64, 8, 1])".into())
            );
        }

        #[test]
        fn failures_are_none() {
            let api = fake_api(MAJOR, std::ptr::null_mut());
            // SAFETY: `fake_dltensor` accepts null and fails.
            assert!(unsafe { api.dltensor(std::ptr::null_mut()) }.is_none());
            let mut missing = fake_api(MAJOR, std::ptr::null_mut());
            missing.dltensor_from_py_object_no_sync = None;
            missing.current_work_stream = None;
            let mut t = FakeTensor {
                shape: [1, 1, 1],
                strides: [1, 1, 1],
            };
            // SAFETY: nothing is called.
            assert!(unsafe { missing.dltensor(std::ptr::from_mut(&mut t).cast()) }.is_none());
            // SAFETY: nothing is called.
            assert!(unsafe { missing.current_cuda_stream(0) }.is_none());
        }

        #[test]
        fn the_current_stream_is_the_producers() {
            let api = fake_api(MAJOR, std::ptr::null_mut());
            // SAFETY: `fake_stream` needs nothing.
            assert_eq!(unsafe { api.current_cuda_stream(2) }, Some(0x5002));
        }
    }
}
