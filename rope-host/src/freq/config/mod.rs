//! A model config's `rope_scaling` (transformers 5 calls it `rope_parameters`) read into a
//! [`FrequencySpec`]: from the object's entries as [`ConfigValue`]s (what the Python binding
//! builds from a dict) or from its JSON text ([`FrequencySpec::from_rope_scaling_json`]).
//!
//! Keys are the config's own: `rope_type` (or the older `type`), `factor`,
//! `original_max_position_embeddings`, `attention_factor`, `beta_fast`, `beta_slow`, `mscale`,
//! `mscale_all_dim`, `truncate`, `short_factor`, `long_factor`, `low_freq_factor`,
//! `high_freq_factor`, `mixed_b` (vLLM's `ntk`), and the ones transformers 5 moved into the
//! object, `rope_theta` and `partial_rotary_factor`. Two lengths that live outside
//! `rope_scaling` go into the same object: `max_position_embeddings` (the config's top-level
//! field) and `seq_len` (the current sequence length, which dynamic NTK and LongRoPE read). A
//! key that no family reads is an error (a misspelt `facter` must not pass silently); a known
//! key that the chosen family does not read is ignored, as transformers ignores it.

use super::{AngleMode, FrequencySpec, RopeScaling, Yarn};
use crate::error::{Error, Result, invalid};

mod json;
#[cfg(test)]
mod tests;

/// A value of a `rope_scaling` entry: what a JSON object or a Python dict holds there.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigValue {
    /// `null` / `None` (treated as absent, as transformers treats `None` entries).
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A floating-point number.
    Float(f64),
    /// A string.
    Str(String),
    /// An array (list, tuple) of numbers.
    List(Vec<f64>),
}

/// Every key a `rope_scaling` object may hold.
pub const ROPE_SCALING_KEYS: &[&str] = &[
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
    "mixed_b",
];

/// The families `rope_type` names.
const FAMILIES: &str = "\"default\", \"linear\", \"dynamic\", \"ntk\", \"yarn\", \"longrope\", \
                        \"llama3\" or \"proportional\"";

/// Base and rotary width as the call gives them, beside the `rope_scaling` object.
#[derive(Clone, Copy, Debug)]
pub struct ConfigBase {
    /// The base, if the call gives one (`rope_theta` in the object wins ties and must agree).
    pub theta: Option<f64>,
    /// The tensors' head size.
    pub head_dim: u32,
    /// The rotated features, if the call gives them (must agree with `partial_rotary_factor`).
    pub rotary_dim: Option<u32>,
    /// How the kernels form angles.
    pub angle: AngleMode,
}

/// The theta a call uses when neither the call nor `rope_theta` gives one.
pub const DEFAULT_THETA: f64 = 10_000.0;

impl FrequencySpec {
    /// The frequencies a `rope_scaling` object describes, from its entries (`entries`, in any
    /// order) and what the call gives beside it (`base`).
    ///
    /// # Errors
    /// [`Error::WrongType`] naming `scaling` for an entry of the wrong type;
    /// [`Error::Invalid`] naming `scaling` (or `theta`/`rotary_dim` when they contradict the
    /// object) for unknown keys, an unknown `rope_type`, missing fields or lengths that are
    /// negative or too large. The domains of the families' parameters are checked later, by
    /// [`FrequencySpec::build`].
    pub fn from_rope_scaling(
        entries: &[(String, ConfigValue)],
        base: ConfigBase,
    ) -> Result<FrequencySpec> {
        let fields = Fields { entries };
        fields.check_keys()?;
        let theta = match (base.theta, fields.float("rope_theta")?) {
            (Some(t), Some(r)) if t != r => {
                return Err(invalid(
                    "theta",
                    format!("{t} differs from scaling[\"rope_theta\"] {r}; give one"),
                ));
            }
            (t, r) => r.or(t).unwrap_or(DEFAULT_THETA),
        };
        let scaling = family(&fields)?;
        let rotary_dim = match scaling {
            // Its share of rotated pairs is the family's, not a narrower rotated slice.
            RopeScaling::Proportional { .. } => whole_head(base)?,
            _ => rotary_dim(&fields, base)?,
        };
        Ok(FrequencySpec {
            theta,
            rotary_dim,
            scaling,
            angle: base.angle,
        })
    }

    /// [`FrequencySpec::from_rope_scaling`] of a `rope_scaling` object's JSON text (the
    /// object itself, for example `config["rope_scaling"]` written out, with
    /// `max_position_embeddings` or `seq_len` added where the family reads them).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `scaling` for text that is not one JSON object of numbers,
    /// strings, booleans, nulls and arrays of numbers; else as
    /// [`FrequencySpec::from_rope_scaling`].
    pub fn from_rope_scaling_json(json: &str, base: ConfigBase) -> Result<FrequencySpec> {
        Self::from_rope_scaling(&json::object(json)?, base)
    }
}

/// The rotated features: `rotary_dim=`, else `int(head_dim * partial_rotary_factor)` as
/// transformers computes it, else `head_dim`.
fn rotary_dim(fields: &Fields<'_>, base: ConfigBase) -> Result<u32> {
    let Some(factor) = fields.float("partial_rotary_factor")? else {
        return Ok(base.rotary_dim.unwrap_or(base.head_dim));
    };
    let factor = super::families::share(factor)?;
    // Truncation, as Python's int() of the product.
    let derived = (f64::from(base.head_dim) * factor) as u32;
    match base.rotary_dim {
        Some(r) if r != derived => Err(invalid(
            "rotary_dim",
            format!(
                "{r} differs from head_dim {} * scaling[\"partial_rotary_factor\"] {factor} \
                 = {derived}; give one",
                base.head_dim
            ),
        )),
        _ => Ok(derived),
    }
}

/// The whole head, which proportional RoPE rotates (its `partial_rotary_factor` is the share
/// of pairs with nonzero frequencies): `rotary_dim=`, when given, must be the head size.
fn whole_head(base: ConfigBase) -> Result<u32> {
    match base.rotary_dim {
        Some(r) if r != base.head_dim => Err(invalid(
            "rotary_dim",
            format!(
                "{r} differs from head_dim {}: proportional RoPE rotates the whole head \
                 (partial_rotary_factor is the share of its pairs with nonzero frequencies)",
                base.head_dim
            ),
        )),
        _ => Ok(base.head_dim),
    }
}

/// The family `rope_type` names, with its fields.
fn family(f: &Fields<'_>) -> Result<RopeScaling> {
    let name = match (f.str("rope_type")?, f.str("type")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(invalid(
                "scaling",
                format!("rope_type {a:?} and type {b:?} disagree"),
            ));
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            return Err(invalid(
                "scaling",
                format!("needs \"rope_type\" (or \"type\"): {FAMILIES}"),
            ));
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
        // transformers reads both with a default of 1.
        "proportional" => RopeScaling::Proportional {
            partial_rotary_factor: f.float("partial_rotary_factor")?.unwrap_or(1.0),
            factor: f.float("factor")?.unwrap_or(1.0),
        },
        "ntk" => RopeScaling::Ntk {
            factor: f.required_float("factor", name)?,
            mixed_b: f.float("mixed_b")?,
        },
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
            return Err(invalid(
                "scaling",
                format!("rope_type must be {FAMILIES}, got {other:?}"),
            ));
        }
    })
}

/// YaRN: the original context is `original_max_position_embeddings`, else
/// `max_position_embeddings`; without `factor`, the ratio of the two (as transformers 5
/// derives it).
fn yarn(f: &Fields<'_>) -> Result<Yarn> {
    let Contexts {
        max,
        original,
        original_given,
    } = f.contexts("yarn")?;
    let factor = match (f.float("factor")?, max) {
        (Some(factor), _) => factor,
        (None, Some(max)) if original_given => f64::from(max) / f64::from(original),
        _ => {
            return Err(invalid(
                "scaling",
                "yarn needs factor (or both max_position_embeddings and \
                 original_max_position_embeddings)",
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
fn longrope(f: &Fields<'_>) -> Result<RopeScaling> {
    let name = "longrope";
    let Contexts { max, original, .. } = f.contexts(name)?;
    let factor = f.float("factor")?;
    let max_position_embeddings = match (max, factor) {
        (Some(max), _) => max,
        // Only the attention factor reads it, and `factor` stands in for its ratio.
        (None, Some(_)) => original,
        (None, None) => {
            return Err(invalid(
                "scaling",
                "longrope needs factor or max_position_embeddings (the extended context) for \
                 its attention factor",
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

/// The context lengths YaRN and LongRoPE read.
struct Contexts {
    /// `max_position_embeddings`, if given.
    max: Option<u32>,
    /// The original context: `original_max_position_embeddings`, else `max_position_embeddings`.
    original: u32,
    /// Whether `original_max_position_embeddings` itself was given.
    original_given: bool,
}

/// Typed access to the dictionary's entries.
struct Fields<'a> {
    entries: &'a [(String, ConfigValue)],
}

impl Fields<'_> {
    /// Every key is one of [`ROPE_SCALING_KEYS`].
    fn check_keys(&self) -> Result<()> {
        match self
            .entries
            .iter()
            .find(|(k, _)| !ROPE_SCALING_KEYS.contains(&k.as_str()))
        {
            None => Ok(()),
            Some((k, _)) => Err(invalid(
                "scaling",
                format!(
                    "unknown key {k:?}; keys are {}",
                    ROPE_SCALING_KEYS.join(", ")
                ),
            )),
        }
    }

    /// The entry `key` unless absent or `None`.
    fn get(&self, key: &str) -> Option<&ConfigValue> {
        self.entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .filter(|v| **v != ConfigValue::Null)
    }

    fn type_error(key: &str, want: &str, got: &ConfigValue) -> Error {
        let got = match got {
            ConfigValue::Null => "null",
            ConfigValue::Bool(_) => "a bool",
            ConfigValue::Int(_) => "an int",
            ConfigValue::Float(_) => "a float",
            ConfigValue::Str(_) => "a str",
            ConfigValue::List(_) => "a list",
        };
        Error::WrongType {
            arg: "scaling",
            problem: format!("entry {key:?} must be {want}, got {got}"),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(ConfigValue::Int(i)) => Ok(Some(*i as f64)),
            Some(ConfigValue::Float(x)) => Ok(Some(*x)),
            Some(other) => Err(Self::type_error(key, "a number", other)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(ConfigValue::Bool(b)) => Ok(Some(*b)),
            Some(other) => Err(Self::type_error(key, "a bool", other)),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(ConfigValue::Str(s)) => Ok(Some(s)),
            Some(other) => Err(Self::type_error(key, "a str", other)),
        }
    }

    /// A whole number of tokens in `0..=max` (integral floats, as some configs store them,
    /// included; zero is rope-host's to reject with the family's message).
    fn whole(&self, key: &str, max: u64) -> Result<Option<u64>> {
        let n = match self.get(key) {
            None => return Ok(None),
            Some(ConfigValue::Int(i)) => *i as f64,
            Some(ConfigValue::Float(x)) => *x,
            Some(other) => return Err(Self::type_error(key, "an int", other)),
        };
        if n.fract() == 0.0 && n >= 0.0 && n <= max as f64 {
            Ok(Some(n as u64))
        } else {
            Err(invalid(
                "scaling",
                format!("{key} must be a whole number of tokens in 0..={max}, got {n}"),
            ))
        }
    }

    fn length(&self, key: &str) -> Result<Option<u32>> {
        Ok(self
            .whole(key, u64::from(u32::MAX))?
            .and_then(|n| u32::try_from(n).ok()))
    }

    /// `seq_len`, which may be one past the largest `u32` position.
    fn seq_len(&self) -> Result<Option<u64>> {
        self.whole("seq_len", u64::from(u32::MAX) + 1)
    }

    fn list(&self, key: &str) -> Result<Option<Vec<f64>>> {
        match self.get(key) {
            None => Ok(None),
            Some(ConfigValue::List(v)) => Ok(Some(v.clone())),
            Some(other) => Err(Self::type_error(key, "a list of numbers", other)),
        }
    }

    /// The context lengths of `family` (named in the error when neither length is given).
    fn contexts(&self, family: &str) -> Result<Contexts> {
        let max = self.length("max_position_embeddings")?;
        let given = self.length("original_max_position_embeddings")?;
        let original = given.or(max).ok_or_else(|| {
            invalid(
                "scaling",
                format!(
                    "{family} needs original_max_position_embeddings (or max_position_embeddings)"
                ),
            )
        })?;
        Ok(Contexts {
            max,
            original,
            original_given: given.is_some(),
        })
    }

    fn missing(key: &str, family: &str) -> Error {
        invalid("scaling", format!("{family} needs {key}"))
    }

    fn required_float(&self, key: &str, family: &str) -> Result<f64> {
        self.float(key)?.ok_or_else(|| Self::missing(key, family))
    }

    fn required_length(&self, key: &str, family: &str) -> Result<u32> {
        self.length(key)?.ok_or_else(|| Self::missing(key, family))
    }

    fn required_list(&self, key: &str, family: &str) -> Result<Vec<f64>> {
        self.list(key)?.ok_or_else(|| Self::missing(key, family))
    }
}
