//! Unit tests of the frequency builders.

use super::*;
use crate::Error;

#[test]
fn checked_inv_freq_is_the_default_family_where_it_is_defined() {
    for (theta, d) in [
        (10_000.0, 128),
        (500_000.0, 64),
        (1.0, 8),
        (0.5, 6),
        (1e300, 2),
    ] {
        assert_eq!(
            checked_inv_freq(theta, d).expect("valid"),
            inv_freq(theta, d)
        );
    }
}

#[test]
fn checked_inv_freq_rejects_theta_whose_frequencies_leave_the_reduction_range() {
    // theta = 1e-300 (the fuzzer's case): theta^(-2i/d) overflows.
    for theta in [
        1e-300,
        0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        f64::MIN_POSITIVE,
    ] {
        let err = checked_inv_freq(theta, 64).expect_err("invalid theta");
        assert!(
            matches!(err, Error::Invalid { arg: "theta", .. }),
            "{theta}: {err}"
        );
    }
    // With d = 4 the largest frequency is theta^(-1/2): 2^20 exactly at theta = 2^-40.
    assert_eq!(
        checked_inv_freq(2f64.powi(-40), 4).expect("at the bound")[1],
        MAX_INV_FREQ
    );
    let err = checked_inv_freq(2f64.powi(-41), 4).expect_err("past the bound");
    assert!(matches!(err, Error::Invalid { arg: "theta", .. }), "{err}");
    // With d = 2 the only frequency is theta^0 = 1, whatever theta.
    assert_eq!(checked_inv_freq(1e-300, 2).expect("one pair"), vec![1.0]);
}

#[test]
fn checked_inv_freq_rejects_odd_or_tiny_rotary_dim() {
    for d in [0, 1, 7] {
        let err = checked_inv_freq(10_000.0, d).expect_err("invalid rotary_dim");
        assert!(
            matches!(
                err,
                Error::Invalid {
                    arg: "rotary_dim",
                    ..
                }
            ),
            "{d}: {err}"
        );
    }
}

#[test]
fn check_theta_agrees_with_checked_inv_freq() {
    for theta in [
        1e-300,
        1e-9,
        1e-6,
        0.01,
        0.5,
        1.0,
        10_000.0,
        1e12,
        0.0,
        -2.0,
        f64::NAN,
    ] {
        for d in [2, 4, 64, 128, 256] {
            assert_eq!(
                check_theta(theta, d).is_ok(),
                checked_inv_freq(theta, d).is_ok(),
                "theta {theta}, rotary_dim {d}"
            );
        }
    }
}
