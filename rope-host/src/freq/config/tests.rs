use super::*;
use crate::error::Error;

fn base() -> ConfigBase {
    ConfigBase {
        theta: None,
        head_dim: 128,
        rotary_dim: None,
        angle: AngleMode::Exact,
    }
}

fn dict(entries: &[(&str, ConfigValue)]) -> Vec<(String, ConfigValue)> {
    entries
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn is_value<T: std::fmt::Debug>(r: Result<T>, needle: &str) {
    match r {
        Err(e @ Error::Invalid { .. }) => {
            let m = e.to_string();
            assert!(m.contains(needle), "{m:?} lacks {needle:?}");
        }
        other => panic!("expected Error::Invalid with {needle:?}, got {other:?}"),
    }
}

fn spec(entries: &[(String, ConfigValue)], base: ConfigBase) -> Result<FrequencySpec> {
    FrequencySpec::from_rope_scaling(entries, base)
}

use ConfigValue::{Bool, Float, Int, List, Str};

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
        let s = spec(&d, ConfigBase { theta, ..base() }).expect("valid");
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
    fn proportional_rotates_the_whole_head_and_keeps_partial_rotary_factor_as_its_share() {
        // Gemma 4's full-attention layers: rope_parameters {"rope_type": "proportional",
        // "partial_rotary_factor": 0.25, "rope_theta": 1e6}, global_head_dim 512.
        let gemma4 = dict(&[
            ("rope_type", Str("proportional".into())),
            ("partial_rotary_factor", Float(0.25)),
            ("rope_theta", Float(1e6)),
        ]);
        let base = ConfigBase {
            head_dim: 512,
            ..base()
        };
        let s = spec(&gemma4, base).expect("valid");
        assert_eq!((s.theta, s.rotary_dim), (1e6, 512));
        assert_eq!(
            s.scaling,
            RopeScaling::Proportional {
                partial_rotary_factor: 0.25,
                factor: 1.0
            }
        );
        let (f, _) = s.build().expect("valid");
        assert_eq!(f.iter().filter(|&&v| v > 0.0).count(), 64);
        // Without the share, the whole head rotates as the default family.
        let whole = dict(&[("rope_type", Str("proportional".into()))]);
        let s = spec(&whole, base).expect("valid");
        assert_eq!(s.build().expect("valid").0, crate::inv_freq(10_000.0, 512));
        // A rotated width other than the head's contradicts the family.
        let narrower = ConfigBase {
            rotary_dim: Some(128),
            ..base
        };
        is_value(
            spec(&gemma4, narrower),
            "rotary_dim: 128 differs from head_dim 512",
        );
    }

    #[test]
    fn ntk_reads_factor_and_an_optional_mixed_b() {
        // Alibaba-NLP/gte-multilingual-base's block (head_dim 64, rope_theta 20000), as vLLM's
        // `get_rope` reads it for `NTKScalingRotaryEmbedding`.
        let base = ConfigBase {
            theta: Some(20_000.0),
            head_dim: 64,
            ..base()
        };
        let gte = dict(&[("type", Str("ntk".into())), ("factor", Float(8.0))]);
        let s = spec(&gte, base).expect("valid");
        assert_eq!((s.theta, s.rotary_dim), (20_000.0, 64));
        assert_eq!(
            s.scaling,
            RopeScaling::Ntk {
                factor: 8.0,
                mixed_b: None
            }
        );
        let mixed = dict(&[
            ("rope_type", Str("ntk".into())),
            ("factor", Int(12)),
            ("mixed_b", Float(0.75)),
        ]);
        assert_eq!(
            spec(&mixed, base).expect("valid").scaling,
            RopeScaling::Ntk {
                factor: 12.0,
                mixed_b: Some(0.75)
            }
        );
        is_value(
            spec(&dict(&[("rope_type", Str("ntk".into()))]), base),
            "factor",
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
            ("beta_fast", ConfigValue::Null),
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
        let same = ConfigBase {
            theta: Some(1e6),
            rotary_dim: Some(64),
            ..base()
        };
        assert!(spec(&d, same).is_ok());
        is_value(
            spec(
                &d,
                ConfigBase {
                    theta: Some(1e4),
                    ..base()
                },
            ),
            "theta: 10000 differs from scaling[\"rope_theta\"] 1000000",
        );
        is_value(
            spec(
                &d,
                ConfigBase {
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
        is_value(spec(&d, base()), "scaling: unknown key \"facter\"");
        let d = dict(&[("rope_type", Str("ntk_by_parts".into()))]);
        is_value(spec(&d, base()), "rope_type must be \"default\"");
        is_value(spec(&dict(&[]), base()), "scaling: needs \"rope_type\"");
    }

    #[test]
    fn wrong_types_are_type_errors() {
        let d = dict(&[
            ("rope_type", Str("linear".into())),
            ("factor", Str("4".into())),
        ]);
        let e = spec(&d, base()).expect_err("a str factor");
        assert!(
            matches!(e, Error::WrongType { arg: "scaling", .. }),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "scaling: entry \"factor\" must be a number, got a str"
        );
        let d = dict(&[("rope_type", Int(3))]);
        assert!(matches!(spec(&d, base()), Err(Error::WrongType { .. })));
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

mod json_text {
    use super::*;

    /// The JSON form reads as the entries form does.
    #[test]
    fn json_text_reads_as_its_entries() {
        let text = r#"{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#;
        let from_json = FrequencySpec::from_rope_scaling_json(text, base()).expect("valid");
        let d = dict(&[
            ("rope_type", Str("llama3".into())),
            ("factor", Float(8.0)),
            ("low_freq_factor", Float(1.0)),
            ("high_freq_factor", Float(4.0)),
            ("original_max_position_embeddings", Int(8192)),
        ]);
        assert_eq!(from_json, spec(&d, base()).expect("valid"));
        is_value(
            FrequencySpec::from_rope_scaling_json("{\"rope_type\": ", base()),
            "scaling: not a JSON object",
        );
    }
}
