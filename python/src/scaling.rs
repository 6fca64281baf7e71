//! The `scaling=` argument: a Hugging Face `rope_scaling` dictionary (transformers 5 calls it
//! `rope_parameters`) read into rope-host's [`FrequencySpec`]. Nothing here touches Python, so
//! it is tested by `cargo test`; `native.rs` converts the dictionary's values into [`Value`]s.
//!
//! Keys are the config's own: `rope_type` (or the older `type`), `factor`,
//! `original_max_position_embeddings`, `attention_factor`, `beta_fast`, `beta_slow`, `mscale`,
//! `mscale_all_dim`, `truncate`, `short_factor`, `long_factor`, `low_freq_factor`,
//! `high_freq_factor`, and the ones transformers 5 moved into the dictionary, `rope_theta` and
//! `partial_rotary_factor`. Two lengths that live outside `rope_scaling` go into the same
//! dictionary: `max_position_embeddings` (the config's top-level field) and `seq_len` (the
//! current sequence length, which dynamic NTK and LongRoPE read). A key that no family reads is
//! an error (a misspelt `facter` must not pass silently); a known key that the chosen family
//! does not read is ignored, as transformers ignores it.

use rope_host::{AngleMode, FrequencySpec, RopeScaling, Yarn};

use crate::dlpack::ArgError;

/// A value of a `scaling` entry, as Python gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None` (treated as absent, as transformers treats `None` entries).
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A list or tuple of numbers.
    List(Vec<f64>),
}

/// Every key `scaling` accepts.
pub const KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "factor",
    "original_max_position_embeddings",
    "max_position_embeddings",
    "seq_len",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "short_factor",
    "long_factor",
    "low_freq_factor",
    "high_freq_factor",
];

/// The families `rope_type` names.
const FAMILIES: &str = "\"default\", \"linear\", \"dynamic\", \"yarn\", \"longrope\" or \"llama3\"";

/// Base and rotary width as the call gives them, beside the dictionary.
#[derive(Clone, Copy, Debug)]
pub struct Base {
    /// `theta=`, if given.
    pub theta: Option<f64>,
    /// The tensors' head size.
    pub head_dim: u32,
    /// `rotary_dim=`, if given.
    pub rotary_dim: Option<u32>,
    /// `angle=`.
    pub angle: AngleMode,
}

/// The theta a call uses when neither `theta=` nor `rope_theta` gives one.
pub const DEFAULT_THETA: f64 = 10_000.0;

/// Reads `entries` (the dictionary's items) with `base` into a frequency description.
///
/// # Errors
/// [`ArgError::Type`] for an entry of the wrong Python type; [`ArgError::Value`] naming
/// `scaling` (or `theta`/`rotary_dim` when they contradict the dictionary) for unknown keys,
/// an unknown `rope_type`, missing fields or lengths that are negative or too large. The
/// domains of the families' parameters are rope-host's to check
/// ([`FrequencySpec::build`]).
pub fn spec(entries: &[(String, Value)], base: Base) -> Result<FrequencySpec, ArgError> {
    let fields = Fields { entries };
    fields.check_keys()?;
    let theta = match (base.theta, fields.float("rope_theta")?) {
        (Some(t), Some(r)) if t != r => {
            return Err(ArgError::Value(format!(
                "theta: {t} differs from scaling[\"rope_theta\"] {r}; give one"
            )));
        }
        (t, r) => r.or(t).unwrap_or(DEFAULT_THETA),
    };
    let rotary_dim = rotary_dim(&fields, base)?;
    let scaling = family(&fields)?;
    Ok(FrequencySpec {
        theta,
        rotary_dim,
        scaling,
        angle: base.angle,
    })
}

/// The rotated features: `rotary_dim=`, else `int(head_dim * partial_rotary_factor)` as
/// transformers computes it, else `head_dim`.
fn rotary_dim(fields: &Fields<'_>, base: Base) -> Result<u32, ArgError> {
    let Some(factor) = fields.float("partial_rotary_factor")? else {
        return Ok(base.rotary_dim.unwrap_or(base.head_dim));
    };
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(ArgError::Value(format!(
            "scaling: partial_rotary_factor must lie in (0, 1], got {factor}"
        )));
    }
    // Truncation, as Python's int() of the product.
    let derived = (f64::from(base.head_dim) * factor) as u32;
    match base.rotary_dim {
        Some(r) if r != derived => Err(ArgError::Value(format!(
            "rotary_dim: {r} differs from head_dim {} * scaling[\"partial_rotary_factor\"] {factor} \
             = {derived}; give one",
            base.head_dim
        ))),
        _ => Ok(derived),
    }
}

/// The family `rope_type` names, with its fields.
fn family(f: &Fields<'_>) -> Result<RopeScaling, ArgError> {
    let name = match (f.str("rope_type")?, f.str("type")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(ArgError::Value(format!(
                "scaling: rope_type {a:?} and type {b:?} disagree"
            )));
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            return Err(ArgError::Value(format!(
                "scaling needs \"rope_type\" (or \"type\"): {FAMILIES}"
            )));
        }
    };
    Ok(match name {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: f.required_float("factor", name)?,
        },
        "dynamic" => {
            let max_position_embeddings = f.required_length("max_position_embeddings", name)?;
            RopeScaling::DynamicNtk {
                factor: f.required_float("factor", name)?,
                max_position_embeddings,
                seq_len: f.seq_len()?.unwrap_or(u64::from(max_position_embeddings)),
            }
        }
        "yarn" => RopeScaling::Yarn(yarn(f)?),
        "longrope" => longrope(f)?,
        "llama3" => RopeScaling::Llama3 {
            factor: f.required_float("factor", name)?,
            low_freq_factor: f.required_float("low_freq_factor", name)?,
            high_freq_factor: f.required_float("high_freq_factor", name)?,
            original_max_position_embeddings: f
                .required_length("original_max_position_embeddings", name)?,
        },
        other => {
            return Err(ArgError::Value(format!(
                "scaling: rope_type must be {FAMILIES}, got {other:?}"
            )));
        }
    })
}

/// YaRN: the original context is `original_max_position_embeddings`, else
/// `max_position_embeddings`; without `factor`, the ratio of the two (as transformers 5
/// derives it).
fn yarn(f: &Fields<'_>) -> Result<Yarn, ArgError> {
    let max = f.length("max_position_embeddings")?;
    let original = f
        .length("original_max_position_embeddings")?
        .or(max)
        .ok_or_else(|| {
            ArgError::Value(
                "scaling: yarn needs original_max_position_embeddings (or \
                 max_position_embeddings)"
                    .into(),
            )
        })?;
    let factor = match (f.float("factor")?, max) {
        (Some(factor), _) => factor,
        (None, Some(max)) if f.length("original_max_position_embeddings")?.is_some() => {
            f64::from(max) / f64::from(original)
        }
        _ => {
            return Err(ArgError::Value(
                "scaling: yarn needs factor (or both max_position_embeddings and \
                 original_max_position_embeddings)"
                    .into(),
            ));
        }
    };
    let mut y = Yarn::new(factor, original);
    // transformers reads `get("beta_fast") or 32`: absent, None and 0 take the default.
    if let Some(b) = f.float("beta_fast")?.filter(|&b| b != 0.0) {
        y.beta_fast = b;
    }
    if let Some(b) = f.float("beta_slow")?.filter(|&b| b != 0.0) {
        y.beta_slow = b;
    }
    y.mscale = f.float("mscale")?;
    y.mscale_all_dim = f.float("mscale_all_dim")?;
    y.attention_factor = f.float("attention_factor")?;
    if let Some(t) = f.bool("truncate")? {
        y.truncate = t;
    }
    Ok(y)
}

/// LongRoPE: the original context is `original_max_position_embeddings`, else
/// `max_position_embeddings`; `max_position_embeddings` matters only without `factor`; short
/// factors unless `seq_len` exceeds the original context.
fn longrope(f: &Fields<'_>) -> Result<RopeScaling, ArgError> {
    let name = "longrope";
    let max = f.length("max_position_embeddings")?;
    let original = f
        .length("original_max_position_embeddings")?
        .or(max)
        .ok_or_else(|| {
            ArgError::Value(
                "scaling: longrope needs original_max_position_embeddings (or \
                 max_position_embeddings)"
                    .into(),
            )
        })?;
    let factor = f.float("factor")?;
    let max_position_embeddings = match (max, factor) {
        (Some(max), _) => max,
        // Only the attention factor reads it, and `factor` stands in for its ratio.
        (None, Some(_)) => original,
        (None, None) => {
            return Err(ArgError::Value(
                "scaling: longrope needs factor or max_position_embeddings (the extended \
                 context) for its attention factor"
                    .into(),
            ));
        }
    };
    Ok(RopeScaling::LongRope {
        short_factor: f.required_list("short_factor", name)?,
        long_factor: f.required_list("long_factor", name)?,
        factor,
        original_max_position_embeddings: original,
        max_position_embeddings,
        seq_len: f.seq_len()?.unwrap_or(u64::from(original)),
        attention_factor: f.float("attention_factor")?,
    })
}

/// Typed access to the dictionary's entries.
struct Fields<'a> {
    entries: &'a [(String, Value)],
}

impl Fields<'_> {
    /// Every key is one of [`KEYS`].
    fn check_keys(&self) -> Result<(), ArgError> {
        match self
            .entries
            .iter()
            .find(|(k, _)| !KEYS.contains(&k.as_str()))
        {
            None => Ok(()),
            Some((k, _)) => Err(ArgError::Value(format!(
                "scaling has an unknown key {k:?}; keys are {}",
                KEYS.join(", ")
            ))),
        }
    }

    /// The entry `key` unless absent or `None`.
    fn get(&self, key: &str) -> Option<&Value> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .filter(|v| **v != Value::None)
    }

    fn type_error(key: &str, want: &str, got: &Value) -> ArgError {
        let got = match got {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::List(_) => "list",
        };
        ArgError::Type(format!("scaling[{key:?}] must be {want}, got {got}"))
    }

    fn float(&self, key: &str) -> Result<Option<f64>, ArgError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Int(i)) => Ok(Some(*i as f64)),
            Some(Value::Float(x)) => Ok(Some(*x)),
            Some(other) => Err(Self::type_error(key, "a number", other)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ArgError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(Self::type_error(key, "a bool", other)),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>, ArgError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(other) => Err(Self::type_error(key, "a str", other)),
        }
    }

    /// A whole number of tokens in `0..=max` (integral floats, as some configs store them,
    /// included; zero is rope-host's to reject with the family's message).
    fn whole(&self, key: &str, max: u64) -> Result<Option<u64>, ArgError> {
        let n = match self.get(key) {
            None => return Ok(None),
            Some(Value::Int(i)) => *i as f64,
            Some(Value::Float(x)) => *x,
            Some(other) => return Err(Self::type_error(key, "an int", other)),
        };
        if n.fract() == 0.0 && n >= 0.0 && n <= max as f64 {
            Ok(Some(n as u64))
        } else {
            Err(ArgError::Value(format!(
                "scaling: {key} must be a whole number of tokens in 0..={max}, got {n}"
            )))
        }
    }

    fn length(&self, key: &str) -> Result<Option<u32>, ArgError> {
        Ok(self
            .whole(key, u64::from(u32::MAX))?
            .map(|n| u32::try_from(n).expect("whole() bounded it by u32::MAX")))
    }

    /// `seq_len`, which may be one past the largest `u32` position.
    fn seq_len(&self) -> Result<Option<u64>, ArgError> {
        self.whole("seq_len", u64::from(u32::MAX) + 1)
    }

    fn list(&self, key: &str) -> Result<Option<Vec<f64>>, ArgError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::List(v)) => Ok(Some(v.clone())),
            Some(other) => Err(Self::type_error(key, "a list of numbers", other)),
        }
    }

    fn missing(key: &str, family: &str) -> ArgError {
        ArgError::Value(format!("scaling: {family} needs {key}"))
    }

    fn required_float(&self, key: &str, family: &str) -> Result<f64, ArgError> {
        self.float(key)?.ok_or_else(|| Self::missing(key, family))
    }

    fn required_length(&self, key: &str, family: &str) -> Result<u32, ArgError> {
        self.length(key)?.ok_or_else(|| Self::missing(key, family))
    }

    fn required_list(&self, key: &str, family: &str) -> Result<Vec<f64>, ArgError> {
        self.list(key)?.ok_or_else(|| Self::missing(key, family))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Base {
        Base {
            theta: None,
            head_dim: 128,
            rotary_dim: None,
            angle: AngleMode::Exact,
        }
    }

    fn dict(entries: &[(&str, Value)]) -> Vec<(String, Value)> {
        entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    fn is_value<T: std::fmt::Debug>(r: Result<T, ArgError>, needle: &str) {
        match r {
            Err(ArgError::Value(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
            other => panic!("expected a ValueError with {needle:?}, got {other:?}"),
        }
    }

    use Value::{Bool, Float, Int, List, Str};

    mod families {
        use super::*;

        #[test]
        fn llama3_reads_its_four_fields() {
            let d = dict(&[
                ("rope_type", Str("llama3".into())),
                ("factor", Float(8.0)),
                ("low_freq_factor", Float(1.0)),
                ("high_freq_factor", Float(4.0)),
                ("original_max_position_embeddings", Int(8192)),
            ]);
            let theta = Some(500_000.0);
            let s = spec(&d, Base { theta, ..base() }).expect("valid");
            assert_eq!((s.theta, s.rotary_dim), (500_000.0, 128));
            assert_eq!(
                s.scaling,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }
            );
        }

        #[test]
        fn yarn_takes_defaults_and_derives_a_missing_factor() {
            // DeepSeek-V3's block, with the older "type" key.
            let d = dict(&[
                ("type", Str("yarn".into())),
                ("factor", Int(40)),
                ("beta_fast", Int(32)),
                ("beta_slow", Int(1)),
                ("mscale", Float(1.0)),
                ("mscale_all_dim", Float(1.0)),
                ("original_max_position_embeddings", Int(4096)),
            ]);
            let RopeScaling::Yarn(y) = spec(&d, base()).expect("valid").scaling else {
                panic!("yarn");
            };
            let mut want = Yarn::new(40.0, 4096);
            (want.mscale, want.mscale_all_dim) = (Some(1.0), Some(1.0));
            assert_eq!(y, want);
            // gpt-oss: truncate false; no factor: the ratio of the two lengths.
            let d = dict(&[
                ("rope_type", Str("yarn".into())),
                ("beta_fast", Value::None),
                ("truncate", Bool(false)),
                ("max_position_embeddings", Int(131_072)),
                ("original_max_position_embeddings", Int(4096)),
            ]);
            let RopeScaling::Yarn(y) = spec(&d, base()).expect("valid").scaling else {
                panic!("yarn");
            };
            assert_eq!((y.factor, y.beta_fast, y.truncate), (32.0, 32.0, false));
            is_value(
                spec(&dict(&[("rope_type", Str("yarn".into()))]), base()),
                "yarn needs original_max_position_embeddings",
            );
        }

        #[test]
        fn dynamic_and_longrope_default_to_the_unextended_length() {
            let d = dict(&[
                ("rope_type", Str("dynamic".into())),
                ("factor", Float(2.0)),
                ("max_position_embeddings", Int(4096)),
            ]);
            assert_eq!(
                spec(&d, base()).expect("valid").scaling,
                RopeScaling::DynamicNtk {
                    factor: 2.0,
                    max_position_embeddings: 4096,
                    seq_len: 4096,
                }
            );
            let d = dict(&[
                ("rope_type", Str("longrope".into())),
                ("short_factor", List(vec![1.0; 48])),
                ("long_factor", List(vec![2.0; 48])),
                ("original_max_position_embeddings", Int(4096)),
                ("max_position_embeddings", Int(131_072)),
                ("seq_len", Int(5000)),
            ]);
            let s = spec(&d, base()).expect("valid");
            let RopeScaling::LongRope {
                factor,
                original_max_position_embeddings,
                max_position_embeddings,
                seq_len,
                ..
            } = s.scaling
            else {
                panic!("longrope");
            };
            assert_eq!(factor, None);
            assert_eq!(
                (
                    original_max_position_embeddings,
                    max_position_embeddings,
                    seq_len
                ),
                (4096, 131_072, 5000)
            );
            is_value(
                spec(&dict(&[("rope_type", Str("dynamic".into()))]), base()),
                "scaling: dynamic needs max_position_embeddings",
            );
        }
    }

    mod base_fields {
        use super::*;

        #[test]
        fn rope_theta_and_partial_rotary_factor_come_from_the_dict() {
            let d = dict(&[
                ("rope_type", Str("default".into())),
                ("rope_theta", Float(1e6)),
                ("partial_rotary_factor", Float(0.5)),
            ]);
            let s = spec(&d, base()).expect("valid");
            assert_eq!((s.theta, s.rotary_dim), (1e6, 64));
            let same = Base {
                theta: Some(1e6),
                rotary_dim: Some(64),
                ..base()
            };
            assert!(spec(&d, same).is_ok());
            is_value(
                spec(
                    &d,
                    Base {
                        theta: Some(1e4),
                        ..base()
                    },
                ),
                "theta: 10000 differs from scaling[\"rope_theta\"] 1000000",
            );
            is_value(
                spec(
                    &d,
                    Base {
                        rotary_dim: Some(32),
                        ..base()
                    },
                ),
                "rotary_dim: 32 differs",
            );
        }

        #[test]
        fn theta_defaults_to_ten_thousand() {
            let d = dict(&[("rope_type", Str("linear".into())), ("factor", Int(4))]);
            let s = spec(&d, base()).expect("valid");
            assert_eq!(s.theta, DEFAULT_THETA);
            assert_eq!(s.scaling, RopeScaling::Linear { factor: 4.0 });
        }
    }

    mod rejects {
        use super::*;

        #[test]
        fn unknown_keys_and_families() {
            let d = dict(&[("rope_type", Str("linear".into())), ("facter", Int(4))]);
            is_value(spec(&d, base()), "scaling has an unknown key \"facter\"");
            let d = dict(&[("rope_type", Str("ntk".into()))]);
            is_value(spec(&d, base()), "rope_type must be \"default\"");
            is_value(spec(&dict(&[]), base()), "scaling needs \"rope_type\"");
        }

        #[test]
        fn wrong_types_are_type_errors() {
            let d = dict(&[
                ("rope_type", Str("linear".into())),
                ("factor", Str("4".into())),
            ]);
            assert_eq!(
                spec(&d, base()),
                Err(ArgError::Type(
                    "scaling[\"factor\"] must be a number, got str".into()
                ))
            );
            let d = dict(&[("rope_type", Int(3))]);
            assert!(matches!(spec(&d, base()), Err(ArgError::Type(_))));
        }

        #[test]
        fn lengths_must_be_whole_and_in_range() {
            let d = |v| {
                dict(&[
                    ("rope_type", Str("dynamic".into())),
                    ("factor", Int(2)),
                    ("max_position_embeddings", v),
                ])
            };
            is_value(spec(&d(Int(-1)), base()), "whole number of tokens");
            is_value(spec(&d(Float(4096.5)), base()), "whole number of tokens");
            is_value(spec(&d(Int(1 << 33)), base()), "whole number of tokens");
            assert!(spec(&d(Float(4096.0)), base()).is_ok());
        }
    }
}
