//! The benchmark's JSON report: one object with the device, the run counts, the empty launch,
//! a row per measured case and the reference copies.

use std::fmt::Debug;

use rope_host::{Direction, RopeStyle};
use serde::{Serialize, Serializer};

use crate::timing::Runs;

/// Everything `rope-bench` measured in one run, as written to its JSON file.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The device's name.
    pub device: String,
    /// The CUDA driver API version, `1000 * major + 10 * minor`.
    pub driver_api: i32,
    /// The warm-up and timed runs behind every median.
    pub runs: Runs,
    /// Median time of an empty kernel launch on one thread, in µs.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub empty_launch_us: f64,
    /// One row per case, pairing, sin/cos source and direction.
    pub rows: Vec<Row>,
    /// The plain copy kernels next to the driver's copy.
    pub reference_copies: Vec<CopyRow>,
    /// A decode step eager and inside a CUDA graph, per launch.
    pub decode_graph: Vec<crate::decode::DecodeRow>,
    /// The fused kernels at decode and prefill, eager and inside a CUDA graph, per launch.
    pub fused: Vec<crate::fused::FusedRow>,
}

/// One measured case with one pairing, sin/cos source and direction.
#[derive(Debug, Serialize)]
pub struct Row {
    /// The benchmark case (`prefill`, `training`, `decode`, ...).
    pub case: &'static str,
    /// The element type (`f32`, `f16` or `bf16`).
    pub dtype: &'static str,
    /// The pairing, written `interleaved` or `neox`.
    #[serde(serialize_with = "lowercase_debug")]
    pub style: RopeStyle,
    /// Where sin/cos come from: `table` or `computed`.
    pub sincos: &'static str,
    /// Written `forward` or `backward`.
    #[serde(serialize_with = "lowercase_debug")]
    pub direction: Direction,
    /// Bytes RoPE must read plus write.
    pub bytes: u64,
    /// Median RoPE time in µs.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub rope_us: f64,
    /// Median time of a device-to-device copy of `bytes / 2` bytes in µs.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub copy_us: f64,
    /// `bytes` over `rope_us`, in GB/s.
    #[serde(serialize_with = "decimals::<1, _>")]
    pub gbps: f64,
    /// `copy_us / rope_us`.
    #[serde(serialize_with = "decimals::<4, _>")]
    pub vs_copy: f64,
    /// Largest absolute error against the f64 reference over the checked elements.
    pub max_abs_err: f64,
    /// The performance issue's target for this row as a fraction of the copy (`vs_copy` at
    /// least this).
    #[serde(serialize_with = "decimals::<4, _>")]
    pub target_vs_copy: f64,
    /// The best existing kernel's share of the copy on this row where the issue measured one
    /// (for example `"Liger 93.8%"`).
    pub best_peer: Option<&'static str>,
}

/// One plain copy kernel's median time next to the driver's copy of the same bytes.
#[derive(Debug, Serialize)]
pub struct CopyRow {
    /// The kernel's entry point.
    pub kernel: &'static str,
    /// Median kernel time in µs.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub kernel_us: f64,
    /// Median time of the driver's copy in µs.
    #[serde(serialize_with = "decimals::<3, _>")]
    pub driver_copy_us: f64,
}

impl Report {
    /// The report as pretty-printed JSON, ending in a newline.
    pub fn to_json(&self) -> String {
        let mut json = serde_json::to_string_pretty(self)
            .expect("plain structs with string keys always serialize");
        json.push('\n');
        json
    }
}

/// Serializes `v` rounded to `DIGITS` decimal places: CUDA events resolve about 0.5 µs, so
/// digits past these are noise.
fn decimals<const DIGITS: i32, S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    let scale = 10f64.powi(DIGITS);
    s.serialize_f64((v * scale).round() / scale)
}

/// Serializes `v` as its `Debug` text in lower case (`Neox` as `neox`).
fn lowercase_debug<T: Debug, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:?}").to_lowercase())
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// A report of one row and one copy, with more digits than it keeps.
    fn sample() -> Report {
        Report {
            device: "GPU".into(),
            driver_api: 13000,
            runs: Runs {
                warmup: 10,
                timed: 100,
            },
            empty_launch_us: 4.99201,
            rows: vec![Row {
                case: "prefill",
                dtype: "bf16",
                style: RopeStyle::Neox,
                sincos: "table",
                direction: Direction::Forward,
                bytes: 167_772_160,
                rope_us: 48.223_998,
                copy_us: 43.904_001,
                gbps: 3479.04,
                vs_copy: 0.910_41,
                max_abs_err: 1.5625e-2,
                target_vs_copy: 0.97,
                best_peer: Some("Liger 93.8%"),
            }],
            reference_copies: vec![CopyRow {
                kernel: "rope_bench_copy1",
                kernel_us: 137.568_01,
                driver_copy_us: 128.512,
            }],
            decode_graph: vec![crate::decode::DecodeRow {
                variant: "copy of the same bytes".into(),
                eager_us: 3.64,
                graph_us: 1.1,
            }],
            fused: Vec::new(),
        }
    }

    /// The keys of every object and the kind of every value (arrays by their first element).
    fn shape(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                Value::Object(m.iter().map(|(k, v)| (k.clone(), shape(v))).collect())
            }
            Value::Array(a) => Value::Array(a.first().map(shape).into_iter().collect()),
            Value::String(_) => "string".into(),
            Value::Number(_) => "number".into(),
            Value::Bool(_) => "bool".into(),
            Value::Null => "null".into(),
        }
    }

    #[test]
    fn json_rounds_to_the_printed_digits() {
        let got: Value = serde_json::from_str(&sample().to_json()).expect("valid JSON");
        let want = serde_json::json!({
            "device": "GPU",
            "driver_api": 13000,
            "runs": {"warmup": 10, "timed": 100},
            "empty_launch_us": 4.992,
            "rows": [{
                "case": "prefill", "dtype": "bf16", "style": "neox", "sincos": "table",
                "direction": "forward", "bytes": 167772160, "rope_us": 48.224,
                "copy_us": 43.904, "gbps": 3479.0, "vs_copy": 0.9104, "max_abs_err": 0.015625,
                "target_vs_copy": 0.97, "best_peer": "Liger 93.8%"
            }],
            "reference_copies": [
                {"kernel": "rope_bench_copy1", "kernel_us": 137.568, "driver_copy_us": 128.512}
            ],
            "decode_graph": [
                {"variant": "copy of the same bytes", "eager_us": 3.64, "graph_us": 1.1}
            ],
            "fused": []
        });
        assert_eq!(got, want);
    }

    #[test]
    fn json_has_the_fields_of_the_committed_reports() {
        let committed: Value =
            serde_json::from_str(include_str!("../../docs/bench/2026-11-21-h200-v20.json"))
                .expect("valid JSON");
        let mut got: Value = serde_json::from_str(&sample().to_json()).expect("valid JSON");
        // Fields added since that report; every field it has keeps its name and shape.
        let top = got.as_object_mut().expect("an object");
        top.remove("decode_graph");
        top.remove("fused");
        for row in top["rows"].as_array_mut().expect("rows") {
            let row = row.as_object_mut().expect("a row");
            row.remove("target_vs_copy");
            row.remove("best_peer");
        }
        assert_eq!(shape(&got), shape(&committed));
    }
}
