//! Rotary frequencies computed on the host in `f64`.

/// The default RoPE frequencies for `rotary_dim` rotated features:
/// `inv_freq[i] = theta^(-2i / rotary_dim)` for `i < rotary_dim / 2`, in `f64`.
pub fn inv_freq(theta: f64, rotary_dim: u32) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|i| theta.powf(-2.0 * f64::from(i) / f64::from(rotary_dim)))
        .collect()
}
