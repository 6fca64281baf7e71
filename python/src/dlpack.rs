//! DLPack's C structures (declared here from the DLPack specification, `dlpack.h`) and their
//! reading into rope-host's raw forms. Nothing here touches Python, so it is tested by
//! `cargo test` without an interpreter; `native.rs` obtains the [`DLTensor`] from the capsule.

use std::ffi::c_void;

use rope_host::{
    CacheLayout, DType, Fp8Format, Layout, RawBuf, RawFp8Scale, RawInts, RawTensor, TableShape,
};

/// `kDLCUDA`: memory of a CUDA device.
pub const DL_CUDA: i32 = 2;

/// `DLDevice`: where a tensor lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// `DLDeviceType` (a C enum, `int`-sized): 1 CPU, 2 CUDA, ...
    pub device_type: i32,
    /// The device ordinal.
    pub device_id: i32,
}

/// `DLDataType`: an element type.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// `DLDataTypeCode`: 0 int, 1 uint, 2 float, 4 bfloat, ...
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes per element (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`: a tensor's address, device, type, shape and strides (not owned).
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The base address (of the allocation; the first element is `byte_offset` bytes later).
    pub data: *mut c_void,
    /// Where `data` lives.
    pub device: DLDevice,
    /// Dimensions.
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` extents.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for a compact row-major tensor.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: a [`DLTensor`] with the producer's context and the deleter that frees it,
/// what a `"dltensor"` capsule points to.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's state (for example the tensor it keeps alive).
    pub manager_ctx: *mut c_void,
    /// Releases the tensor; called once by whoever owns it (the capsule while it is named
    /// `"dltensor"`, a consumer that renamed it to `"used_dltensor"`).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// An argument's problem, raised in Python as `TypeError` or `ValueError`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ArgError {
    /// The argument has the wrong Python type.
    Type(String),
    /// The argument has the right type but an unsupported value.
    Value(String),
}

/// The element types rope_rs reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// `float32`.
    F32,
    /// `float16`.
    F16,
    /// `bfloat16`.
    BF16,
    /// `float64` (frequency vectors only: the kernels read `inv_freq` in `f64`).
    F64,
    /// `int32`.
    I32,
    /// `int64`.
    I64,
    /// `uint8` (FP8 caches stored as bytes, as vLLM allocates them).
    U8,
    /// `float8_e4m3fn` (FP8 E4M3 caches and outputs).
    E4m3,
    /// `float8_e5m2` (FP8 E5M2 caches and outputs).
    E5m2,
}

impl Elem {
    fn from_dl(t: DLDataType) -> Option<Self> {
        match (t.code, t.bits, t.lanes) {
            (2, 32, 1) => Some(Self::F32),
            (2, 16, 1) => Some(Self::F16),
            (4, 16, 1) => Some(Self::BF16),
            (2, 64, 1) => Some(Self::F64),
            (0, 32, 1) => Some(Self::I32),
            (0, 64, 1) => Some(Self::I64),
            (1, 8, 1) => Some(Self::U8),
            (10, 8, 1) => Some(Self::E4m3),
            (12, 8, 1) => Some(Self::E5m2),
            _ => None,
        }
    }

    /// The name PyTorch gives the type.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
            Self::F64 => "float64",
            Self::I32 => "int32",
            Self::I64 => "int64",
            Self::U8 => "uint8",
            Self::E4m3 => "float8_e4m3fn",
            Self::E5m2 => "float8_e5m2",
        }
    }

    /// The rope-host element type of a tensor or table type (`float64` is not one).
    pub fn float(self) -> Option<DType> {
        match self {
            Self::F32 => Some(DType::F32),
            Self::F16 => Some(DType::F16),
            Self::BF16 => Some(DType::BF16),
            Self::F64 | Self::I32 | Self::I64 | Self::U8 | Self::E4m3 | Self::E5m2 => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::U8 | Self::E4m3 | Self::E5m2 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }

    /// Whether FP8 bytes of `format` are stored in it (`uint8`, or the format's own type).
    pub fn holds(self, format: Fp8Format) -> bool {
        match format {
            Fp8Format::E4m3 => matches!(self, Self::U8 | Self::E4m3),
            Fp8Format::E5m2 => matches!(self, Self::U8 | Self::E5m2),
        }
    }
}

/// The name of a DLPack device type, for messages.
pub fn device_name(device_type: i32) -> String {
    match device_type {
        1 => "CPU".into(),
        2 => "CUDA".into(),
        3 => "CUDAHost".into(),
        4 => "OpenCL".into(),
        7 => "Vulkan".into(),
        8 => "Metal".into(),
        9 => "VPI".into(),
        10 => "ROCM".into(),
        11 => "ROCMHost".into(),
        13 => "CUDAManaged".into(),
        14 => "OneAPI".into(),
        other => format!("device type {other}"),
    }
}

/// The most dimensions a tensor rope_rs reads may have (its forms have at most five).
pub const MAX_DIMS: usize = 8;

/// A tensor's extents or strides, at most [`MAX_DIMS`], kept inline: a launch reads up to a
/// dozen tensors and allocates nothing for them. Reads as a slice (and compares as one).
#[derive(Clone, Copy)]
pub struct Dims {
    len: usize,
    values: [usize; MAX_DIMS],
}

impl Dims {
    /// `values` as dimensions; `None` for more than [`MAX_DIMS`].
    pub fn from_slice(values: &[usize]) -> Option<Self> {
        let mut d = Self {
            len: values.len(),
            values: [0; MAX_DIMS],
        };
        d.values.get_mut(..values.len())?.copy_from_slice(values);
        Some(d)
    }

    /// The dimensions.
    pub fn as_slice(&self) -> &[usize] {
        &self.values[..self.len]
    }
}

impl std::ops::Deref for Dims {
    type Target = [usize];
    fn deref(&self) -> &[usize] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [usize] {
        &mut self.values[..self.len]
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Dims {}

impl std::hash::Hash for Dims {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl std::fmt::Debug for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// What rope_rs needs of a CUDA tensor: the address of its first element, its element type,
/// its extents and its strides in elements (never negative).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dense {
    /// `data + byte_offset`.
    pub ptr: u64,
    /// The element type.
    pub elem: Elem,
    /// Extents.
    pub shape: Dims,
    /// Strides in elements.
    pub strides: Dims,
    /// The CUDA device ordinal.
    pub device_id: i32,
}

/// Reads `t`, named `arg` in errors: a CUDA tensor of a supported type with non-negative
/// strides.
///
/// # Errors
/// [`ArgError::Value`] for another device, an unsupported type, negative extents or strides.
///
/// # Safety
/// `t.shape` points to `t.ndim` `i64`, and `t.strides` is null or points to as many (what a
/// live `DLTensor` guarantees).
pub unsafe fn read(t: &DLTensor, arg: &str) -> Result<Dense, ArgError> {
    let value = |m: String| ArgError::Value(format!("{arg} {m}"));
    if t.device.device_type != DL_CUDA {
        return Err(value(format!(
            "must be a CUDA tensor (DLPack device type 2), got {}",
            device_name(t.device.device_type)
        )));
    }
    let Some(elem) = Elem::from_dl(t.dtype) else {
        let DLDataType { code, bits, lanes } = t.dtype;
        return Err(value(format!(
            "has an unsupported element type (DLPack code {code}, {bits} bits, {lanes} lanes)"
        )));
    };
    let ndim = usize::try_from(t.ndim)
        .ok()
        .filter(|&n| n <= MAX_DIMS)
        .ok_or_else(|| value(format!("has {} dimensions, more than {MAX_DIMS}", t.ndim)))?;
    let extents: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: the caller promises `shape` points to `ndim` i64.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let mut shape = [0; MAX_DIMS];
    for (to, &n) in shape.iter_mut().zip(extents) {
        *to = usize::try_from(n).map_err(|_| value(format!("has a negative extent {n}")))?;
    }
    let mut strides = [1; MAX_DIMS];
    if t.strides.is_null() || ndim == 0 {
        for i in (0..ndim.saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1].max(1);
        }
    } else {
        // SAFETY: the caller promises non-null `strides` point to `ndim` i64.
        let given = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        for (to, &s) in strides.iter_mut().zip(given) {
            *to = usize::try_from(s)
                .map_err(|_| value(format!("has a negative stride {s} (strides {given:?})")))?;
        }
    }
    let dims = |values| Dims { len: ndim, values };
    let (shape, strides) = (dims(shape), dims(strides));
    let ptr = (t.data as u64)
        .checked_add(t.byte_offset)
        .ok_or_else(|| value("has an address past 2^64".into()))?;
    Ok(Dense {
        ptr,
        elem,
        shape,
        strides,
        device_id: t.device.device_id,
    })
}

/// `dims`/`strides` as a rope-host tensor whose buffer starts at `ptr` and ends after its last
/// element.
fn raw_tensor(
    ptr: u64,
    dims: [usize; 4],
    strides: [usize; 4],
    arg: &str,
) -> Result<RawTensor, ArgError> {
    if strides[3] != 1 && dims[3] > 1 {
        return Err(ArgError::Value(format!(
            "{arg} must have a contiguous last dimension (stride 1), got strides {strides:?}"
        )));
    }
    let layout = Layout::strided(dims, [strides[0], strides[1], strides[2], 1], 0)
        .map_err(|e| ArgError::Value(format!("{arg}: {e}")))?;
    let len = layout
        .end()
        .ok_or_else(|| ArgError::Value(format!("{arg} spans more than 2^64 elements")))?;
    Ok(RawTensor {
        buf: RawBuf { ptr, len },
        layout,
    })
}

/// How the dimensions of a tensor to rotate map onto rope-host's `[batch, seq, heads,
/// head_dim]` (the `layout=` argument).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorLayout {
    /// `[batch, seq, heads, head_dim]` (the default for 4-D tensors).
    Bshd,
    /// Time-major `[seq, batch, heads, head_dim]` (Megatron).
    Sbhd,
    /// `[batch, heads, seq, head_dim]` (Hugging Face's attention layout).
    Bhsd,
    /// Packed `[tokens, heads, head_dim]` (the default, and the only layout, for 3-D tensors).
    Thd,
}

impl TensorLayout {
    /// Parses the `layout=` argument: `None` picks by rank.
    ///
    /// # Errors
    /// [`ArgError::Value`] naming `layout` for another name.
    pub fn parse(name: Option<&str>) -> Result<Option<Self>, ArgError> {
        Ok(match name {
            None => None,
            Some("bshd") => Some(Self::Bshd),
            Some("sbhd") => Some(Self::Sbhd),
            Some("bhsd") => Some(Self::Bhsd),
            Some("thd") => Some(Self::Thd),
            Some(other) => {
                return Err(ArgError::Value(format!(
                    "layout must be \"bshd\", \"sbhd\", \"bhsd\" or \"thd\", got {other:?}"
                )));
            }
        })
    }

    /// The name `layout=` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bshd => "bshd",
            Self::Sbhd => "sbhd",
            Self::Bhsd => "bhsd",
            Self::Thd => "thd",
        }
    }
}

/// A tensor to rotate, its dimensions read by `layout` (`None`: `[batch, seq, heads,
/// head_dim]` for 4-D tensors, `[tokens, heads, head_dim]` for 3-D ones).
///
/// # Errors
/// [`ArgError::Value`] for a rank the layout does not have, or a last stride other than 1.
pub fn rope_tensor(
    d: &Dense,
    layout: Option<TensorLayout>,
    arg: &str,
) -> Result<RawTensor, ArgError> {
    use TensorLayout::{Bhsd, Bshd, Sbhd, Thd};
    match (layout, d.shape.as_slice(), d.strides.as_slice()) {
        (None | Some(Bshd), &[b, s, h, e], &[sb, ss, sh, se]) => {
            raw_tensor(d.ptr, [b, s, h, e], [sb, ss, sh, se], arg)
        }
        (Some(Sbhd), &[s, b, h, e], &[ss, sb, sh, se]) => {
            raw_tensor(d.ptr, [b, s, h, e], [sb, ss, sh, se], arg)
        }
        (Some(Bhsd), &[b, h, s, e], &[sb, sh, ss, se]) => {
            raw_tensor(d.ptr, [b, s, h, e], [sb, ss, sh, se], arg)
        }
        (None | Some(Thd), &[t, h, e], &[st, sh, se]) => {
            raw_tensor(d.ptr, [1, t, h, e], [0, st, sh, se], arg)
        }
        (None, shape, _) => Err(ArgError::Value(format!(
            "{arg} must be [batch, seq, heads, head_dim] or [tokens, heads, head_dim], got shape \
             {shape:?}"
        ))),
        (Some(layout), shape, _) => {
            let want = match layout {
                Bshd => "[batch, seq, heads, head_dim]",
                Sbhd => "[seq, batch, heads, head_dim]",
                Bhsd => "[batch, heads, seq, head_dim]",
                Thd => "[tokens, heads, head_dim]",
            };
            Err(ArgError::Value(format!(
                "{arg} must be {want} for layout {:?}, got shape {shape:?}",
                layout.name()
            )))
        }
    }
}

/// vLLM's query or key: `[num_tokens, num_heads * head_size]` (seen as `[num_tokens, num_heads,
/// head_size]`) or `[num_tokens, num_heads, head_size]`.
///
/// # Errors
/// [`ArgError::Value`] for another rank, a row not made of whole heads, or a last stride other
/// than 1.
pub fn heads_tensor(d: &Dense, head_size: usize, arg: &str) -> Result<RawTensor, ArgError> {
    if head_size == 0 {
        return Err(ArgError::Value("head_size must be positive".into()));
    }
    match (d.shape.as_slice(), d.strides.as_slice()) {
        (&[t, row], &[st, se]) => {
            if !row.is_multiple_of(head_size) {
                return Err(ArgError::Value(format!(
                    "{arg} rows of {row} elements are not whole heads of head_size {head_size}"
                )));
            }
            if se != 1 && row > 1 {
                return Err(ArgError::Value(format!(
                    "{arg} must have a contiguous last dimension (stride 1), got strides [{st}, {se}]"
                )));
            }
            let heads = row / head_size;
            raw_tensor(d.ptr, [1, t, heads, head_size], [0, st, head_size, 1], arg)
        }
        (&[_, _, e], _) if e != head_size => Err(ArgError::Value(format!(
            "{arg} has heads of {e} elements, head_size is {head_size}"
        ))),
        (&[t, h, e], &[st, sh, se]) => raw_tensor(d.ptr, [1, t, h, e], [0, st, sh, se], arg),
        (shape, _) => Err(ArgError::Value(format!(
            "{arg} must be [num_tokens, num_heads * head_size] or [num_tokens, num_heads, \
             head_size], got shape {shape:?}"
        ))),
    }
}

/// Whether `d` is compact row-major (size-1 dimensions may have any stride).
fn is_contiguous(d: &Dense) -> bool {
    let mut want = 1;
    for (&n, &s) in d.shape.iter().zip(d.strides.iter()).rev() {
        if n > 1 && s != want {
            return false;
        }
        want *= n;
    }
    true
}

/// Position ids: a contiguous `int32`/`int64` tensor of one or two dimensions (`[seq]` or
/// `[batch, seq]`).
///
/// # Errors
/// [`ArgError::Value`] for another type, rank or a non-contiguous tensor.
pub fn ints(d: &Dense, arg: &str) -> Result<RawInts, ArgError> {
    let ty = int_type(d, arg)?;
    if !matches!(d.shape.len(), 1 | 2) {
        return Err(ArgError::Value(format!(
            "{arg} must be [seq] or [batch, seq], got shape {:?}",
            d.shape
        )));
    }
    contiguous_ints(d, arg, ty)
}

/// Per-axis positions (mRoPE's `position_ids`): `[n_axes, batch, seq]` or `[n_axes, tokens]`,
/// contiguous, `int32` or `int64`, read as `n_axes` rows of the tokens in order.
///
/// # Errors
/// [`ArgError::Value`] naming `arg` for another type, rank or first dimension, or a
/// non-contiguous array.
pub fn axis_ints(d: &Dense, arg: &str, n_axes: usize) -> Result<RawInts, ArgError> {
    if !matches!(d.shape.len(), 2 | 3) || d.shape[0] != n_axes {
        return Err(ArgError::Value(format!(
            "{arg} must be [{n_axes}, batch, seq] or [{n_axes}, tokens] (a row of positions per \
             axis), got shape {:?}",
            d.shape
        )));
    }
    let ty = int_type(d, arg)?;
    contiguous_ints(d, arg, ty)
}

/// `d`'s elements in order as `ty` integers: a contiguous array.
fn contiguous_ints(d: &Dense, arg: &str, ty: rope_host::IntType) -> Result<RawInts, ArgError> {
    require_contiguous(d, arg)?;
    Ok(RawInts {
        buf: RawBuf {
            ptr: d.ptr,
            len: d.shape.iter().product(),
        },
        ty,
    })
}

/// `d`'s integer type, `int32` or `int64`.
fn int_type(d: &Dense, arg: &str) -> Result<rope_host::IntType, ArgError> {
    match d.elem {
        Elem::I32 => Ok(rope_host::IntType::I32),
        Elem::I64 => Ok(rope_host::IntType::I64),
        other => Err(ArgError::Value(format!(
            "{arg} must be int32 or int64, got {}",
            other.name()
        ))),
    }
}

/// A one-dimensional integer array (row offsets, `cu_seqlens`, per-sequence offsets):
/// `[n]`, contiguous, `int32` or `int64`; `what` describes `n` in errors.
///
/// # Errors
/// [`ArgError::Value`] for another type or rank.
pub fn ints_1d(d: &Dense, arg: &str, what: &str) -> Result<RawInts, ArgError> {
    if d.shape.len() != 1 {
        return Err(ArgError::Value(format!(
            "{arg} must be one-dimensional [{what}], got shape {:?}",
            d.shape
        )));
    }
    ints(d, arg)
}

/// A one-dimensional `int32` array of `what` (FlashInfer's page-table arrays).
///
/// # Errors
/// [`ArgError::Value`] naming `arg` for another rank or type, as [`ints_1d`].
pub fn i32_1d(d: &Dense, arg: &str, what: &str) -> Result<RawBuf, ArgError> {
    let ints = ints_1d(d, arg, what)?;
    if ints.ty != rope_host::IntType::I32 {
        return Err(ArgError::Value(format!(
            "{arg} must be int32, got {}",
            d.elem.name()
        )));
    }
    Ok(ints.buf)
}

/// The element type of a tensor of floats: float32, float16 or bfloat16.
///
/// # Errors
/// [`ArgError::Value`] naming `arg` for any other type.
pub fn float_type(d: &Dense, arg: &str) -> Result<DType, ArgError> {
    d.elem.float().ok_or_else(|| {
        ArgError::Value(format!(
            "{arg} must be float32, float16 or bfloat16, got {}",
            d.elem.name()
        ))
    })
}

/// A contiguous two-dimensional floating-point tensor: its buffer, type, rows and columns.
fn float_matrix(d: &Dense, arg: &str, want: &str) -> Result<(RawBuf, DType, usize, u32), ArgError> {
    let dtype = float_type(d, arg)?;
    let &[rows, cols] = d.shape.as_slice() else {
        return Err(ArgError::Value(format!(
            "{arg} must be {want}, got shape {:?}",
            d.shape
        )));
    };
    require_contiguous(d, arg)?;
    let cols_u32 =
        u32::try_from(cols).map_err(|_| ArgError::Value(format!("{arg} has {cols} columns")))?;
    let buf = RawBuf {
        ptr: d.ptr,
        len: rows * cols,
    };
    Ok((buf, dtype, rows, cols_u32))
}

/// A combined cos/sin cache `[max_position, rotary_dim]` (cos half, then sin half), contiguous,
/// of a floating-point type.
///
/// # Errors
/// [`ArgError::Value`] for another type, rank or a non-contiguous tensor.
pub fn cos_sin_cache(d: &Dense, arg: &str) -> Result<(RawBuf, DType, TableShape), ArgError> {
    let (buf, dtype, max_position, rotary_dim) =
        float_matrix(d, arg, "[max_position, rotary_dim]")?;
    Ok((
        buf,
        dtype,
        TableShape {
            max_position,
            rotary_dim,
        },
    ))
}

/// One of the separate tables `cos` and `sin`: `[max_position, rotary_dim / 2]`, contiguous, of
/// a floating-point type; its shape states `rotary_dim`, twice its width.
///
/// # Errors
/// [`ArgError::Value`] for another type, rank or a non-contiguous tensor, or a width whose
/// double overflows.
pub fn half_table(d: &Dense, arg: &str) -> Result<(RawBuf, DType, TableShape), ArgError> {
    let (buf, dtype, max_position, half) = float_matrix(d, arg, "[max_position, rotary_dim / 2]")?;
    let rotary_dim = half
        .checked_mul(2)
        .ok_or_else(|| ArgError::Value(format!("{arg} has {half} columns")))?;
    Ok((
        buf,
        dtype,
        TableShape {
            max_position,
            rotary_dim,
        },
    ))
}

/// A frequency vector on the device: `[rotary_dim / 2]`, contiguous, `float64` (the kernels
/// read `f64` frequencies). Returns the buffer and the `rotary_dim` it serves.
///
/// # Errors
/// [`ArgError::Value`] for another type or rank, or a length whose double overflows a `u32`.
pub fn inv_freq(d: &Dense, arg: &str) -> Result<(RawBuf, u32), ArgError> {
    if d.elem != Elem::F64 {
        return Err(ArgError::Value(format!(
            "{arg} on the device must be float64 (the kernels read f64 frequencies), got {}; \
             convert it (inv_freq.double() in PyTorch) or pass a list of floats",
            d.elem.name()
        )));
    }
    let &[n] = d.shape.as_slice() else {
        return Err(ArgError::Value(format!(
            "{arg} must be one-dimensional [rotary_dim / 2], got shape {:?}",
            d.shape
        )));
    };
    require_contiguous(d, arg)?;
    let rotary_dim = u32::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(2))
        .filter(|&r| r > 0)
        .ok_or_else(|| {
            ArgError::Value(format!(
                "{arg} holds {n} frequencies; rotary_dim, twice that, must be in 2..2^32"
            ))
        })?;
    Ok((RawBuf { ptr: d.ptr, len: n }, rotary_dim))
}

/// A contiguous vector of `n` elements of type `elem` (normalisation weights `[head_dim]`).
///
/// # Errors
/// [`ArgError::Value`] for another type or element count, or a non-contiguous tensor.
pub fn vector(d: &Dense, arg: &str, elem: Elem, n: usize) -> Result<RawBuf, ArgError> {
    if d.elem != elem {
        return Err(ArgError::Value(format!(
            "{arg} must be {} (the tensors' type), got {}",
            elem.name(),
            d.elem.name()
        )));
    }
    let len: usize = d.shape.iter().product();
    if len != n || d.shape.len() != 1 {
        return Err(ArgError::Value(format!(
            "{arg} must be [{n}], got shape {:?}",
            d.shape
        )));
    }
    require_contiguous(d, arg)?;
    Ok(RawBuf { ptr: d.ptr, len })
}

/// An FP8 scale on the device: a contiguous `float32` tensor of one element (per tensor) or one
/// per head (rope-host checks the count against the heads).
///
/// # Errors
/// [`ArgError::Value`] for another type, no element, or a non-contiguous tensor.
pub fn fp8_scale(d: &Dense, arg: &str) -> Result<RawFp8Scale, ArgError> {
    if d.elem != Elem::F32 {
        return Err(ArgError::Value(format!(
            "{arg} must be float32, got {}",
            d.elem.name()
        )));
    }
    require_contiguous(d, arg)?;
    let buf = RawBuf {
        ptr: d.ptr,
        len: d.shape.iter().product(),
    };
    match buf.len {
        0 => Err(ArgError::Value(format!("{arg} is empty"))),
        1 => Ok(RawFp8Scale::PerTensor(buf)),
        _ => Ok(RawFp8Scale::PerHead(buf)),
    }
}

/// A KV cache (one of k's and v's) and its layout: vLLM's paged
/// `[num_blocks, block_size, kv_heads, head_size]` (4-D, any strides, slot `s` at row
/// `s % block_size` of block `s / block_size`), or a token pool `[slots, kv_heads * head_size]`
/// or `[slots, kv_heads, head_size]` (SGLang's, slot `s` at row `s`). Returns the buffer, in
/// elements of the cache's type, and the layout.
///
/// # Errors
/// [`ArgError::Value`] for another rank, rows not made of whole heads, or a last stride other
/// than 1.
pub fn cache(d: &Dense, head_size: usize, arg: &str) -> Result<(RawBuf, CacheLayout), ArgError> {
    let layout = match (d.shape.as_slice(), d.strides.as_slice()) {
        (&[blocks, rows, heads, e], &[sb, sr, sh, se]) if se == 1 || e <= 1 => CacheLayout {
            num_blocks: blocks,
            block_size: rows,
            kv_heads: heads,
            head_dim: e,
            strides: [sb, sr, sh],
        },
        (&[slots, row], &[ss, se]) if se == 1 || row <= 1 => {
            if head_size == 0 || !row.is_multiple_of(head_size) {
                return Err(ArgError::Value(format!(
                    "{arg} rows of {row} elements are not whole heads of {head_size}"
                )));
            }
            CacheLayout {
                num_blocks: slots,
                block_size: 1,
                kv_heads: row / head_size,
                head_dim: head_size,
                strides: [ss, ss, head_size],
            }
        }
        (&[slots, heads, e], &[ss, sh, se]) if se == 1 || e <= 1 => CacheLayout {
            num_blocks: slots,
            block_size: 1,
            kv_heads: heads,
            head_dim: e,
            strides: [ss, ss, sh],
        },
        (&[.., _], &[.., se]) if matches!(d.shape.len(), 2..=4) && se != 1 => {
            return Err(ArgError::Value(format!(
                "{arg} must have a contiguous last dimension (stride 1), got strides {:?}",
                d.strides
            )));
        }
        (shape, _) => {
            return Err(ArgError::Value(format!(
                "{arg} must be [num_blocks, block_size, num_kv_heads, head_size] or \
                 [num_slots, num_kv_heads * head_size], got shape {shape:?}"
            )));
        }
    };
    Ok((
        RawBuf {
            ptr: d.ptr,
            len: span(d, arg)?,
        },
        layout,
    ))
}

/// One of MLA's paged latent caches (FlashInfer's `ckv_cache` and `kpe_cache`): `[max_pages,
/// page_size, dim]` with a contiguous last dimension, read as pages of `page_size` slots of one
/// head of `dim` elements. Returns the buffer, in bytes for FP8, and the layout.
///
/// # Errors
/// [`ArgError::Value`] for another rank or a last stride other than 1.
pub fn latent_cache(d: &Dense, arg: &str) -> Result<(RawBuf, CacheLayout), ArgError> {
    let (&[pages, page_size, dim], &[sp, ss, se]) = (d.shape.as_slice(), d.strides.as_slice())
    else {
        return Err(ArgError::Value(format!(
            "{arg} must be [max_pages, page_size, dim] (MLA's paged caches), got shape {:?}",
            d.shape
        )));
    };
    if se != 1 && dim > 1 {
        return Err(ArgError::Value(format!(
            "{arg} must have a contiguous last dimension (stride 1), got strides {:?}",
            d.strides
        )));
    }
    let layout = CacheLayout {
        num_blocks: pages,
        block_size: page_size,
        kv_heads: 1,
        head_dim: dim,
        strides: [sp, ss, dim],
    };
    Ok((
        RawBuf {
            ptr: d.ptr,
            len: span(d, arg)?,
        },
        layout,
    ))
}

/// Columns `start..start + width` of `d`'s last dimension, as a tensor of its own: the same
/// extents and strides but the last, `width`, from element `start` of each row on (vLLM's MLA
/// cache `[num_blocks, block_size, kv_lora_rank + rot_dim]` read as its latent part and its
/// rotated k's).
///
/// # Errors
/// [`ArgError::Value`] for a tensor without dimensions, a last stride other than 1, or columns
/// past the last dimension.
pub fn columns(d: &Dense, (start, width): (usize, usize), arg: &str) -> Result<Dense, ArgError> {
    let (Some(&last), Some(&stride)) = (d.shape.as_slice().last(), d.strides.as_slice().last())
    else {
        return Err(ArgError::Value(format!("{arg} has no dimensions")));
    };
    if stride != 1 && last > 1 {
        return Err(ArgError::Value(format!(
            "{arg} must have a contiguous last dimension (stride 1), got strides {:?}",
            d.strides
        )));
    }
    if start.checked_add(width).is_none_or(|end| end > last) {
        return Err(ArgError::Value(format!(
            "{arg} rows hold {last} elements, not columns {start}..{}",
            start.saturating_add(width)
        )));
    }
    let mut shape = d.shape.as_slice().to_vec();
    *shape.last_mut().expect("has dimensions") = width;
    Ok(Dense {
        ptr: d.ptr + (start * d.elem.size()) as u64,
        shape: Dims::from_slice(&shape).expect("as many dimensions as d"),
        ..d.clone()
    })
}

/// The elements from `d`'s first to past its last (0 when it has none).
fn span(d: &Dense, arg: &str) -> Result<usize, ArgError> {
    if d.shape.contains(&0) {
        return Ok(0);
    }
    d.shape
        .iter()
        .zip(d.strides.iter())
        .try_fold(1usize, |end, (&n, &s)| {
            (n - 1).checked_mul(s).and_then(|x| x.checked_add(end))
        })
        .ok_or_else(|| ArgError::Value(format!("{arg} spans more than 2^64 elements")))
}

/// `Ok` when `d` is contiguous, else an error naming `arg` with its strides and shape.
fn require_contiguous(d: &Dense, arg: &str) -> Result<(), ArgError> {
    if is_contiguous(d) {
        Ok(())
    } else {
        Err(ArgError::Value(format!(
            "{arg} must be contiguous, got strides {:?} for shape {:?}",
            d.strides, d.shape
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake CUDA `DLTensor` over host arrays (never dereferenced at `data`).
    struct Fake {
        shape: Vec<i64>,
        strides: Option<Vec<i64>>,
        dtype: DLDataType,
        device_type: i32,
        byte_offset: u64,
    }

    const F32: DLDataType = DLDataType {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    const BF16: DLDataType = DLDataType {
        code: 4,
        bits: 16,
        lanes: 1,
    };
    const I64: DLDataType = DLDataType {
        code: 0,
        bits: 64,
        lanes: 1,
    };

    fn fake(shape: &[i64], strides: Option<&[i64]>, dtype: DLDataType) -> Fake {
        Fake {
            shape: shape.to_vec(),
            strides: strides.map(<[i64]>::to_vec),
            dtype,
            device_type: DL_CUDA,
            byte_offset: 0,
        }
    }

    fn read_fake(f: &mut Fake, arg: &str) -> Result<Dense, ArgError> {
        let t = DLTensor {
            data: 0x1000 as *mut c_void,
            device: DLDevice {
                device_type: f.device_type,
                device_id: 0,
            },
            ndim: f.shape.len() as i32,
            dtype: f.dtype,
            shape: f.shape.as_mut_ptr(),
            strides: f
                .strides
                .as_mut()
                .map_or(std::ptr::null_mut(), |s| s.as_mut_ptr()),
            byte_offset: f.byte_offset,
        };
        // SAFETY: `shape` and `strides` point to `ndim` i64 owned by `f`, alive for the call.
        unsafe { read(&t, arg) }
    }

    fn is_value(r: Result<impl std::fmt::Debug, ArgError>, needle: &str) {
        match r {
            Err(ArgError::Value(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
            other => panic!("expected a ValueError with {needle:?}, got {other:?}"),
        }
    }

    mod reads {
        use super::*;

        #[test]
        fn null_strides_are_row_major() {
            let d = read_fake(&mut fake(&[2, 3, 4, 8], None, BF16), "q").expect("valid");
            assert_eq!(d.strides.as_slice(), [96, 32, 8, 1]);
            assert_eq!(d.elem, Elem::BF16);
            assert_eq!(d.ptr, 0x1000);
        }

        #[test]
        fn byte_offset_moves_the_address() {
            let mut f = fake(&[4, 8], None, F32);
            f.byte_offset = 64;
            assert_eq!(read_fake(&mut f, "q").expect("valid").ptr, 0x1040);
        }

        #[test]
        fn rejects_other_devices_naming_the_argument() {
            let mut f = fake(&[4, 2, 8], None, F32);
            f.device_type = 1;
            is_value(
                read_fake(&mut f, "q"),
                "q must be a CUDA tensor (DLPack device type 2), got CPU",
            );
        }

        #[test]
        fn rejects_negative_strides_and_unsupported_types() {
            is_value(
                read_fake(&mut fake(&[4, 8], Some(&[-8, 1]), F32), "k"),
                "k has a negative stride -8",
            );
            let complex64 = DLDataType {
                code: 5,
                bits: 64,
                lanes: 1,
            };
            is_value(
                read_fake(&mut fake(&[4, 8], None, complex64), "q"),
                "unsupported element type",
            );
        }
    }

    mod layouts {
        use super::*;

        #[test]
        fn four_and_three_dimensions() {
            let d = read_fake(&mut fake(&[2, 5, 3, 8], None, F32), "q").expect("valid");
            let t = rope_tensor(&d, None, "q").expect("valid");
            assert_eq!(t.layout, Layout::bshd(2, 5, 3, 8));
            assert_eq!(t.buf.len, 2 * 5 * 3 * 8);
            let d = read_fake(&mut fake(&[5, 3, 8], None, F32), "q").expect("valid");
            let t = rope_tensor(&d, None, "q").expect("valid");
            assert_eq!(
                (t.layout.batch(), t.layout.seq(), t.layout.heads()),
                (1, 5, 3)
            );
            assert_eq!(t.buf.len, 5 * 3 * 8);
        }

        #[test]
        fn strided_views_end_after_their_last_element() {
            // q of a fused QKV [t, (4 + 2 * 2) * 8] seen as [t, 4, 8].
            let d = read_fake(&mut fake(&[6, 4, 8], Some(&[64, 8, 1]), F32), "q").expect("valid");
            let t = rope_tensor(&d, None, "q").expect("valid");
            assert_eq!(t.layout.strides(), [0, 64, 8]);
            assert_eq!(t.buf.len, 5 * 64 + 3 * 8 + 8);
        }

        #[test]
        fn rejects_other_ranks_and_non_unit_last_strides() {
            let d = read_fake(&mut fake(&[4, 8], None, F32), "q").expect("valid");
            is_value(
                rope_tensor(&d, None, "q"),
                "q must be [batch, seq, heads, head_dim]",
            );
            let d = read_fake(&mut fake(&[4, 2, 8], Some(&[32, 16, 2]), F32), "k").expect("ok");
            is_value(
                rope_tensor(&d, None, "k"),
                "k must have a contiguous last dimension",
            );
        }

        #[test]
        fn named_layouts_reorder_the_dimensions() {
            // A contiguous [s=5, b=2, h=3, d=8] tensor read as time-major.
            let d = read_fake(&mut fake(&[5, 2, 3, 8], None, F32), "q").expect("valid");
            let t = rope_tensor(&d, Some(TensorLayout::Sbhd), "q").expect("valid");
            assert_eq!(t.layout, Layout::sbhd(5, 2, 3, 8));
            // Hugging Face's [b=2, h=3, s=5, d=8], contiguous: seq stride 8, head stride 40.
            let d = read_fake(&mut fake(&[2, 3, 5, 8], None, F32), "q").expect("valid");
            let t = rope_tensor(&d, Some(TensorLayout::Bhsd), "q").expect("valid");
            assert_eq!(
                (t.layout.batch(), t.layout.seq(), t.layout.heads()),
                (2, 5, 3)
            );
            assert_eq!(t.layout.strides(), [120, 8, 40]);
            assert_eq!(t.buf.len, 2 * 3 * 5 * 8);
            // The same layout from a transposed [b, s, h, d] (what a q projection's view and
            // transpose(1, 2) give): strides (s*h*d, d, h*d, 1).
            let d = read_fake(&mut fake(&[2, 3, 5, 8], Some(&[120, 8, 24, 1]), F32), "q")
                .expect("valid");
            let t = rope_tensor(&d, Some(TensorLayout::Bhsd), "q").expect("valid");
            assert_eq!(t.layout, Layout::bshd(2, 5, 3, 8));
        }

        #[test]
        fn layouts_name_the_rank_they_need() {
            let d = read_fake(&mut fake(&[5, 3, 8], None, F32), "q").expect("valid");
            is_value(
                rope_tensor(&d, Some(TensorLayout::Bhsd), "q"),
                "q must be [batch, heads, seq, head_dim] for layout \"bhsd\", got shape [5, 3, 8]",
            );
            let d = read_fake(&mut fake(&[2, 5, 3, 8], None, F32), "k").expect("valid");
            is_value(
                rope_tensor(&d, Some(TensorLayout::Thd), "k"),
                "k must be [tokens, heads, head_dim] for layout \"thd\"",
            );
            assert_eq!(
                TensorLayout::parse(Some("sbhd")),
                Ok(Some(TensorLayout::Sbhd))
            );
            is_value(TensorLayout::parse(Some("bsh")), "layout must be");
        }

        #[test]
        fn vllm_rows_split_into_heads() {
            let d = read_fake(&mut fake(&[7, 4 * 16], Some(&[96, 1]), BF16), "query").expect("ok");
            let t = heads_tensor(&d, 16, "query").expect("valid");
            assert_eq!(t.layout.strides(), [0, 96, 16]);
            assert_eq!(
                (t.layout.seq(), t.layout.heads(), t.layout.head_dim()),
                (7, 4, 16)
            );
            assert_eq!(t.buf.len, 6 * 96 + 64);
            is_value(heads_tensor(&d, 24, "query"), "not whole heads");
            let d = read_fake(&mut fake(&[7, 4, 16], None, BF16), "key").expect("valid");
            assert!(heads_tensor(&d, 16, "key").is_ok());
            is_value(heads_tensor(&d, 8, "key"), "head_size is 8");
        }
    }

    mod options {
        use super::*;

        #[test]
        fn position_ids_are_contiguous_ints() {
            let d = read_fake(&mut fake(&[2, 9], None, I64), "position_ids").expect("valid");
            let ids = ints(&d, "position_ids").expect("valid");
            assert_eq!((ids.buf.len, ids.ty), (18, rope_host::IntType::I64));
            let d = read_fake(&mut fake(&[2, 9], Some(&[1, 2]), I64), "position_ids").expect("ok");
            is_value(ints(&d, "position_ids"), "position_ids must be contiguous");
            let d = read_fake(&mut fake(&[9], None, F32), "position_ids").expect("valid");
            is_value(
                ints(&d, "position_ids"),
                "must be int32 or int64, got float32",
            );
        }

        #[test]
        fn one_dimensional_arrays_say_what_they_hold() {
            let d = read_fake(&mut fake(&[5], None, I64), "cu_seqlens").expect("valid");
            let ints = ints_1d(&d, "cu_seqlens", "num_seqs + 1").expect("valid");
            assert_eq!(ints.buf.len, 5);
            let d = read_fake(&mut fake(&[2, 5], None, I64), "cu_seqlens").expect("valid");
            is_value(
                ints_1d(&d, "cu_seqlens", "num_seqs + 1"),
                "cu_seqlens must be one-dimensional [num_seqs + 1], got shape [2, 5]",
            );
        }

        #[test]
        fn separate_tables_state_twice_their_width() {
            let d = read_fake(&mut fake(&[4096, 32], None, BF16), "cos").expect("valid");
            let (buf, dtype, shape) = half_table(&d, "cos").expect("valid");
            assert_eq!((buf.len, dtype), (4096 * 32, DType::BF16));
            assert_eq!((shape.max_position, shape.rotary_dim), (4096, 64));
            let d = read_fake(&mut fake(&[4096, 32], Some(&[64, 1]), F32), "sin").expect("ok");
            is_value(half_table(&d, "sin"), "sin must be contiguous");
        }

        #[test]
        fn device_frequencies_are_float64_vectors() {
            let f64 = DLDataType {
                code: 2,
                bits: 64,
                lanes: 1,
            };
            let d = read_fake(&mut fake(&[64], None, f64), "inv_freq").expect("valid");
            let (buf, rotary_dim) = inv_freq(&d, "inv_freq").expect("valid");
            assert_eq!((buf.len, rotary_dim), (64, 128));
            let d = read_fake(&mut fake(&[64], None, F32), "inv_freq").expect("valid");
            is_value(
                inv_freq(&d, "inv_freq"),
                "inv_freq on the device must be float64",
            );
            let d = read_fake(&mut fake(&[0], None, f64), "inv_freq").expect("valid");
            is_value(inv_freq(&d, "inv_freq"), "rotary_dim, twice that");
        }

        #[test]
        fn columns_are_a_narrower_last_dimension_further_into_each_row() {
            // vLLM's MLA cache [blocks=3, rows=16, 512 + 64] of bf16 at address 0x1000.
            let mut t = fake(&[3, 16, 576], None, BF16);
            let d = read_fake(&mut t, "kv_cache").expect("valid");
            let pe = columns(&d, (512, 64), "kv_cache").expect("inside the rows");
            assert_eq!(
                (pe.ptr, pe.shape.as_slice()),
                (d.ptr + 1024, &[3, 16, 64][..])
            );
            assert_eq!(pe.strides, d.strides);
            let (buf, l) = latent_cache(&pe, "kv_cache").expect("valid");
            assert_eq!(
                (l.head_dim, l.strides, buf.ptr),
                (64, [16 * 576, 576, 64], pe.ptr)
            );
            assert_eq!(buf.len, 2 * 16 * 576 + 15 * 576 + 64);
            let latent = columns(&d, (0, 512), "kv_cache").expect("inside the rows");
            assert_eq!(
                (latent.ptr, latent.shape.as_slice()),
                (d.ptr, &[3, 16, 512][..])
            );
            is_value(columns(&d, (512, 65), "kv_cache"), "not columns 512..577");
            is_value(
                columns(&d, (usize::MAX, 2), "kv_cache"),
                "kv_cache rows hold 576",
            );
            let mut strided = fake(&[3, 16, 576], Some(&[18432, 1152, 2]), BF16);
            let d = read_fake(&mut strided, "kv_cache").expect("valid");
            is_value(
                columns(&d, (0, 512), "kv_cache"),
                "contiguous last dimension",
            );
        }

        #[test]
        fn paged_caches_keep_their_strides_and_pools_are_one_row_blocks() {
            // vLLM's key cache, a view of [2, blocks=3, rows=16, heads=2, d=8] (k's half).
            let d = read_fake(
                &mut fake(&[3, 16, 2, 8], Some(&[512, 16, 8, 1]), BF16),
                "key_cache",
            )
            .expect("valid");
            let (buf, l) = cache(&d, 8, "key_cache").expect("valid");
            assert_eq!(
                (l.num_blocks, l.block_size, l.kv_heads, l.head_dim),
                (3, 16, 2, 8)
            );
            assert_eq!(l.strides, [512, 16, 8]);
            assert_eq!(buf.len, 2 * 512 + 15 * 16 + 8 + 8);
            // SGLang's pool [slots, heads * d]: slot s is block s.
            let d = read_fake(&mut fake(&[100, 16], None, BF16), "k_buffer").expect("valid");
            let (buf, l) = cache(&d, 8, "k_buffer").expect("valid");
            assert_eq!(
                (l.num_blocks, l.block_size, l.kv_heads, l.head_dim),
                (100, 1, 2, 8)
            );
            assert_eq!((l.strides, buf.len), ([16, 16, 8], 1600));
            is_value(cache(&d, 6, "k_buffer"), "not whole heads of 6");
            let d = read_fake(
                &mut fake(&[3, 16, 2, 8], Some(&[512, 16, 16, 2]), BF16),
                "v",
            )
            .expect("valid");
            is_value(cache(&d, 8, "v"), "v must have a contiguous last dimension");
            let d = read_fake(&mut fake(&[8], None, BF16), "v").expect("valid");
            is_value(cache(&d, 8, "v"), "v must be [num_blocks, block_size");
        }

        #[test]
        fn weights_and_scales_are_checked() {
            let d = read_fake(&mut fake(&[64], None, BF16), "q_weight").expect("valid");
            assert_eq!(
                vector(&d, "q_weight", Elem::BF16, 64).expect("valid").len,
                64
            );
            is_value(
                vector(&d, "q_weight", Elem::BF16, 128),
                "q_weight must be [128]",
            );
            is_value(vector(&d, "q_weight", Elem::F32, 64), "must be float32");
            let d = read_fake(&mut fake(&[1], None, F32), "k_scale").expect("valid");
            assert!(matches!(
                fp8_scale(&d, "k_scale"),
                Ok(RawFp8Scale::PerTensor(_))
            ));
            let d = read_fake(&mut fake(&[8], None, F32), "k_scale").expect("valid");
            assert!(matches!(
                fp8_scale(&d, "k_scale"),
                Ok(RawFp8Scale::PerHead(_))
            ));
            let d = read_fake(&mut fake(&[1], None, BF16), "k_scale").expect("valid");
            is_value(fp8_scale(&d, "k_scale"), "k_scale must be float32");
            let e4m3 = DLDataType {
                code: 10,
                bits: 8,
                lanes: 1,
            };
            let d = read_fake(&mut fake(&[4], None, e4m3), "key_cache").expect("valid");
            assert!(d.elem.holds(Fp8Format::E4m3) && d.elem.float().is_none());
            let e5m2 = DLDataType {
                code: 12,
                bits: 8,
                lanes: 1,
            };
            let d = read_fake(&mut fake(&[4], None, e5m2), "key_cache").expect("valid");
            assert!(d.elem.holds(Fp8Format::E5m2) && !d.elem.holds(Fp8Format::E4m3));
            assert_eq!(d.elem.name(), "float8_e5m2");
        }

        #[test]
        fn cos_sin_cache_states_its_shape() {
            let d = read_fake(&mut fake(&[4096, 64], None, F32), "cos_sin_cache").expect("ok");
            let (buf, dtype, shape) = cos_sin_cache(&d, "cos_sin_cache").expect("valid");
            assert_eq!((buf.len, dtype), (4096 * 64, DType::F32));
            assert_eq!((shape.max_position, shape.rotary_dim), (4096, 64));
            let d = read_fake(&mut fake(&[4096], None, F32), "cos_sin_cache").expect("valid");
            is_value(
                cos_sin_cache(&d, "cos_sin_cache"),
                "[max_position, rotary_dim]",
            );
        }
    }
}
