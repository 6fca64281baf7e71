//! candle-transformers' Llama with rope-candle swapped in for `candle_nn::rotary_emb::rope`:
//! a small random model's logits from `candle_transformers::models::llama::Llama` against the
//! same weights run through the same layers here, whose attention rotates q and k with
//! rope-candle (the drop-in `rope` on candle-transformers' own tables, and in-kernel sin/cos
//! from the config's `rope_theta`). GPU only: prints `SKIPPED (no GPU)` without one and fails
//! instead with `ROPE_REQUIRE_GPU=1`.

use std::collections::HashMap;
use std::io::Write;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
use candle_transformers::models::llama::{Cache, Config, Llama};
use candle_transformers::utils::repeat_kv;
use rope_candle::{Axes, Positions, RopeSpec, RopeStyle, SinCos};

mod common;
use common::gpu_or_skip;

type Res = candle_core::Result<()>;

/// Two layers, 4 query heads sharing 2 key/value heads (GQA), head_dim 16.
fn config() -> Config {
    Config {
        hidden_size: 64,
        intermediate_size: 96,
        vocab_size: 50,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    }
}

/// Random weights under the names `Llama::load` reads, in `dtype`.
fn weights(
    cfg: &Config,
    dtype: DType,
    dev: &Device,
) -> candle_core::Result<HashMap<String, Tensor>> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let d = h / cfg.num_attention_heads;
    let kv = cfg.num_key_value_heads * d;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, h]),
        ("model.norm.weight".into(), vec![h]),
        ("lm_head.weight".into(), vec![v, h]),
    ];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            shapes.push((format!("{p}.{name}"), shape));
        }
    }
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let norm = name.ends_with("norm.weight");
            let t = if norm {
                Tensor::rand(0.5f32, 1.5, shape, dev)?
            } else {
                let fan_in = *shape.last().expect("2-D") as f64;
                (Tensor::randn(0f32, 1.0, shape, dev)? / fan_in.sqrt())?
            };
            Ok((name, t.to_dtype(dtype)?))
        })
        .collect()
}

/// How the model here rotates q and k (`[batch, heads, seq, head_dim]`, contiguous).
#[derive(Clone, Copy, Debug)]
enum Rotation {
    /// `rope_candle::rope` on candle-transformers' own cos/sin tables (`Cache::new`'s).
    DropIn,
    /// `rope_candle::apply_qk` with sin/cos computed in the kernel from `rope_theta`.
    Computed,
}

/// Llama's forward pass as candle-transformers computes it (no KV cache, no flash
/// attention), with q and k rotated by `rotation`; the last token's logits, in f32.
fn logits_here(
    w: &HashMap<String, Tensor>,
    cfg: &Config,
    ids: &Tensor,
    rotation: Rotation,
    tables: (&Tensor, &Tensor),
) -> candle_core::Result<Tensor> {
    let (b, s) = ids.dims2()?;
    let heads = cfg.num_attention_heads;
    let kv_heads = cfg.num_key_value_heads;
    let d = cfg.hidden_size / heads;
    let linear = |name: &str| Linear::new(w[name].clone(), None);
    let norm = |name: &str| RmsNorm::new(w[name].clone(), cfg.rms_norm_eps);
    let (cos, sin) = (tables.0.narrow(0, 0, s)?, tables.1.narrow(0, 0, s)?);
    let spec = RopeSpec {
        style: RopeStyle::Neox,
        axes: Axes::Bhsd,
        rotary_dim: None,
        sincos: SinCos::Computed {
            theta: f64::from(cfg.rope_theta),
        },
    };
    let mask: Vec<u8> = (0..s)
        .flat_map(|i| (0..s).map(move |j| u8::from(j > i)))
        .collect();
    let mask = Tensor::from_slice(&mask, (s, s), ids.device())?;

    let embed = Embedding::new(w["model.embed_tokens.weight"].clone(), cfg.hidden_size);
    let mut x = embed.forward(ids)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let residual = x.clone();
        let h = norm(&format!("{p}.input_layernorm.weight")).forward(&x)?;
        let split = |t: Tensor, n: usize| t.reshape((b, s, n, d))?.transpose(1, 2);
        let q = split(
            linear(&format!("{p}.self_attn.q_proj.weight")).forward(&h)?,
            heads,
        )?
        .contiguous()?;
        let k = split(
            linear(&format!("{p}.self_attn.k_proj.weight")).forward(&h)?,
            kv_heads,
        )?
        .contiguous()?;
        let v = split(
            linear(&format!("{p}.self_attn.v_proj.weight")).forward(&h)?,
            kv_heads,
        )?;
        let (q, k) = match rotation {
            Rotation::DropIn => (
                rope_candle::rope(&q, &cos, &sin)?,
                rope_candle::rope(&k, &cos, &sin)?,
            ),
            Rotation::Computed => rope_candle::apply_qk(&q, &k, &spec, Positions::Offset(0))?,
        };
        let k = repeat_kv(k, heads / kv_heads)?;
        let v = repeat_kv(v, heads / kv_heads)?;
        let dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let att = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, ids.device())?.broadcast_as(att.shape())?;
        let att = mask.broadcast_as(att.shape())?.where_cond(&neg_inf, &att)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v.contiguous()?)?.to_dtype(dtype)?;
        let y = y.transpose(1, 2)?.reshape((b, s, cfg.hidden_size))?;
        let x1 = (linear(&format!("{p}.self_attn.o_proj.weight")).forward(&y)? + residual)?;
        let h = norm(&format!("{p}.post_attention_layernorm.weight")).forward(&x1)?;
        let gate =
            candle_nn::ops::silu(&linear(&format!("{p}.mlp.gate_proj.weight")).forward(&h)?)?;
        let up = linear(&format!("{p}.mlp.up_proj.weight")).forward(&h)?;
        x = (linear(&format!("{p}.mlp.down_proj.weight")).forward(&(gate * up)?)? + x1)?;
    }
    let x = norm("model.norm.weight").forward(&x)?;
    let x = x.i((.., s - 1, ..))?.contiguous()?;
    linear("lm_head.weight").forward(&x)?.to_dtype(DType::F32)
}

/// The model's logits from candle-transformers and from the layers here with rope-candle, for
/// a batch of 2 sequences of 9 tokens. f32 weights: equal within 1e-5 (the drop-in on the same
/// tables) and 1e-4 (in-kernel sin/cos) times the largest logit. The same weights in bf16,
/// where both models round at every layer: rope-candle's logits stay as close to the f32
/// model's as candle-transformers' own bf16 logits are (within 1.5 times their distance).
#[test]
fn llama_with_rope_candle_gives_candle_transformers_logits() -> Res {
    let Some(dev) = gpu_or_skip("llama_with_rope_candle_gives_candle_transformers_logits") else {
        return Ok(());
    };
    let cfg = config();
    let w32 = weights(&cfg, DType::F32, &dev)?;
    let ids = Tensor::rand(0f32, cfg.vocab_size as f32, (2, 9), &dev)?
        .floor()?
        .to_dtype(DType::U32)?;
    let mut reference = None;
    for dtype in [DType::F32, DType::BF16] {
        let w: HashMap<String, Tensor> = w32
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?)))
            .collect::<candle_core::Result<_>>()?;
        let model = Llama::load(VarBuilder::from_tensors(w.clone(), dtype, &dev), &cfg)?;
        let mut cache = Cache::new(false, dtype, &cfg, &dev)?;
        let want = model.forward(&ids, 0, &mut cache)?;
        // Cache::new's tables, rebuilt with its arithmetic (its fields are private).
        let tables = llama_tables(&cfg, dtype, &dev)?;
        let f32_logits = reference.get_or_insert_with(|| want.clone()).clone();
        let max_diff = |a: &Tensor, b: &Tensor| -> candle_core::Result<f32> {
            (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
        };
        let scale = f32_logits.abs()?.max_all()?.to_scalar::<f32>()?;
        let theirs = max_diff(&want, &f32_logits)?;
        for rotation in [Rotation::DropIn, Rotation::Computed] {
            let got = logits_here(&w, &cfg, &ids, rotation, (&tables.0, &tables.1))?;
            let to_candle = max_diff(&got, &want)?;
            let ours = max_diff(&got, &f32_logits)?;
            let _ = writeln!(
                std::io::stderr(),
                "llama {dtype:?} {rotation:?}: max |logit difference| to candle-transformers \
                 {to_candle:.3e}; to the f32 model: ours {ours:.3e}, candle-transformers' \
                 {theirs:.3e} (max |logit| {scale:.3})"
            );
            if dtype == DType::F32 {
                let tol = match rotation {
                    Rotation::DropIn => 1e-5,
                    Rotation::Computed => 1e-4,
                };
                assert!(
                    to_candle <= tol * scale,
                    "{rotation:?}: {to_candle} > {tol} * {scale}"
                );
            } else {
                assert!(
                    ours <= 1.5 * theirs,
                    "{dtype:?} {rotation:?}: {ours} from the f32 model, candle-transformers {theirs}"
                );
            }
        }
    }
    Ok(())
}

/// cos and sin `[max_position_embeddings, head_dim / 2]` as `Cache::new` computes them for a
/// config without rope scaling: `inv_freq_i = 1 / theta^(2i / d)` in f32, angles from an f32
/// matrix product of the positions and `inv_freq`, cast to `dtype`.
fn llama_tables(cfg: &Config, dtype: DType, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let d = cfg.hidden_size / cfg.num_attention_heads;
    let inv_freq: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / d as f32))
        .collect();
    let n = inv_freq.len();
    let inv_freq = Tensor::new(inv_freq, dev)?;
    let angles = Tensor::arange(0, cfg.max_position_embeddings as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((cfg.max_position_embeddings, 1))?
        .matmul(&inv_freq.reshape((1, n))?)?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}
