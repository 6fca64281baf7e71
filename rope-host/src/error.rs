//! The one error type of the library.

/// Everything that can go wrong in `rope-host`.
///
/// Validation errors name the argument and the problem, and are returned before anything
/// touches the GPU, so outputs are unchanged when an error is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (`libcuda.so` / `nvcuda.dll`) could not be loaded: no NVIDIA
    /// driver is installed on this machine.
    #[error("no CUDA driver: {0}")]
    NoDriver(&'static str),
    /// A CUDA driver call failed (no device, out of memory, a failed launch, ...).
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// The loaded kernels lack the entry point a launch planned (named here): a defect of
    /// this build of the library, reported instead of panicking; nothing was launched.
    #[error("kernel {0} is not in the loaded module")]
    MissingKernel(&'static str),
    /// The embedded compiled kernels for the architecture named here (`major * 10 + minor`) do
    /// not decompress to what the build recorded: a corrupted build of the library.
    #[error("the embedded cubin for sm_{0} is corrupt")]
    CorruptKernels(u32),
    /// The embedded PTX of the build named here does not decompress to text: a corrupted build
    /// of the library.
    #[error("the embedded PTX of the {0:?} build is corrupt")]
    CorruptPtx(rope_kernels::abi::PtxBuild),
    /// An argument, or an entry of it, has the wrong type (a model config's value that is not
    /// what its key holds); `arg` names it and `problem` says what is wrong.
    #[error("{arg}: {problem}")]
    WrongType {
        /// The argument, as named in the API (for example `"scaling"`).
        arg: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// An argument is invalid; `arg` names it and `problem` says what is wrong.
    #[error("{arg}: {problem}")]
    Invalid {
        /// The argument, as named in the API (for example `"x"` or `"positions"`).
        arg: &'static str,
        /// What is wrong with it, with the values involved.
        problem: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand for an [`Error::Invalid`].
pub(crate) fn invalid(arg: &'static str, problem: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        problem: problem.into(),
    }
}
