//! The crate's error type, and its conversion into candle's.

/// What can go wrong in rope-candle before or during a launch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// rope-host refused the launch (an invalid argument, named) or the driver failed.
    #[error("rope-host: {0}")]
    Rope(#[from] rope_host::Error),
    /// candle failed (allocating the output).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// A tensor cannot be described to rope-host: its rank, dtype, device or strides.
    #[error("{arg}: {problem}")]
    Invalid {
        /// The argument, as the public function names it (`xs`, `cos`, `sin`, `ids`, ...).
        arg: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// A [`Error::Invalid`] for `arg`.
pub(crate) fn invalid(arg: &'static str, problem: impl Into<String>) -> Error {
    Error::Invalid {
        arg,
        problem: problem.into(),
    }
}
