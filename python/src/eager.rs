//! What the drop-ins' eager calls share: torch's objects, found once (an eager call comes with
//! a `torch.Tensor`, so torch is imported already).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple};
use rope_host::Fp8Format;

/// torch's objects the eager calls use, found once per process (an eager call comes with a
/// `torch.Tensor`, so torch is imported already).
pub(crate) struct Torch {
    /// `torch.empty_like`.
    empty_like: Py<PyAny>,
    /// `torch.float8_e4m3fn`.
    e4m3: Py<PyAny>,
    /// `torch.float8_e5m2`.
    e5m2: Py<PyAny>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

/// [`Torch`], found at the first eager call.
pub(crate) fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        Ok(Torch {
            empty_like: torch.getattr("empty_like")?.unbind(),
            e4m3: torch.getattr("float8_e4m3fn")?.unbind(),
            e5m2: torch.getattr("float8_e5m2")?.unbind(),
        })
    })
}

impl Torch {
    /// torch's dtype of `format`.
    pub(crate) fn dtype<'py>(&self, py: Python<'py>, format: Fp8Format) -> &Bound<'py, PyAny> {
        match format {
            Fp8Format::E4m3 => self.e4m3.bind(py),
            Fp8Format::E5m2 => self.e5m2.bind(py),
        }
    }

    /// The format of torch's dtype `dtype`, if it is one of the two.
    pub(crate) fn format(&self, dtype: &Bound<'_, PyAny>) -> Option<Fp8Format> {
        if dtype.is(&self.e4m3) {
            Some(Fp8Format::E4m3)
        } else if dtype.is(&self.e5m2) {
            Some(Fp8Format::E5m2)
        } else {
            None
        }
    }

    /// `torch.empty_like(x, dtype=format)`.
    pub(crate) fn empty_like_fp8<'py>(
        &self,
        x: &Bound<'py, PyAny>,
        format: Fp8Format,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = x.py();
        let kwargs = PyDict::new(py);
        kwargs.set_item(pyo3::intern!(py, "dtype"), self.dtype(py, format))?;
        self.empty_like.bind(py).call((x,), Some(&kwargs))
    }

    /// `torch.empty_like(x)`.
    pub(crate) fn empty_like<'py>(&self, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.empty_like.bind(x.py()).call1((x,))
    }

    /// A new contiguous tensor of `shape` on `like`'s device, of `format`'s type.
    pub(crate) fn new_empty<'py>(
        &self,
        like: &Bound<'py, PyAny>,
        shape: &[usize],
        format: Fp8Format,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = like.py();
        let kwargs = PyDict::new(py);
        kwargs.set_item(pyo3::intern!(py, "dtype"), self.dtype(py, format))?;
        let shape = PyTuple::new(py, shape)?;
        like.call_method(pyo3::intern!(py, "new_empty"), (shape,), Some(&kwargs))
    }
}
