//! The bind step of a launch: device views reduced to addresses and lengths, each checked to
//! belong to the `Rope`'s CUDA context, with cudarc's pointer guards held until the launch has
//! been enqueued (they order later uses of the buffers after it).

use cudarc::driver::{
    CudaContext, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::error::{Result, invalid};

/// A device buffer given by address: `len` elements from `ptr` (a `CUdeviceptr`), what the raw
/// entry [`crate::Rope::run_raw`] takes and what the safe API reduces views to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBuf {
    /// The device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub len: usize,
}

/// Collects the pointer guards of one launch's buffers.
pub(crate) struct Binder<'s> {
    stream: &'s CudaStream,
    guards: Vec<SyncOnDrop<'s>>,
}

impl<'s> Binder<'s> {
    /// A binder for launches on `stream`.
    pub(crate) fn new(stream: &'s CudaStream) -> Self {
        Self {
            stream,
            guards: Vec::new(),
        }
    }

    /// Checks that `buffer` lives in the launch stream's context.
    fn same_context<T>(&self, arg: &'static str, buffer: &impl DeviceSlice<T>) -> Result<()> {
        let (ours, theirs): (&CudaContext, &CudaContext) =
            (self.stream.context(), buffer.stream().context());
        if ours != theirs {
            return Err(invalid(
                arg,
                format!(
                    "belongs to another CUDA context (device {}) than the Rope's (device {})",
                    theirs.ordinal(),
                    ours.ordinal()
                ),
            ));
        }
        Ok(())
    }

    /// A buffer the launch reads.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `arg` when the view belongs to another context.
    pub(crate) fn read<T, V>(&mut self, arg: &'static str, view: &'s V) -> Result<RawBuf>
    where
        V: DevicePtr<T> + DeviceSlice<T>,
    {
        self.same_context(arg, view)?;
        let (ptr, guard) = view.device_ptr(self.stream);
        self.guards.push(guard);
        Ok(RawBuf {
            ptr,
            len: view.len(),
        })
    }

    /// A buffer the launch writes.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `arg` when the view belongs to another context.
    pub(crate) fn write<T>(
        &mut self,
        arg: &'static str,
        view: &'s mut CudaViewMut<'_, T>,
    ) -> Result<RawBuf> {
        self.same_context(arg, view)?;
        let len = view.len();
        let (ptr, guard) = view.device_ptr_mut(self.stream);
        self.guards.push(guard);
        Ok(RawBuf { ptr, len })
    }
}
