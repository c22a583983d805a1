//! The one accuracy fold: how far two f32 buffers are apart, refusing anything that would make
//! "how far" meaningless.
//!
//! Every accuracy check in the workspace (`petite verify`, the golden/parity tests, xtask's
//! conformance tiers) folds its differences through [`max_abs_diff`], so none of them can pass
//! an output that holds a NaN or an infinity (`max` ignores a NaN operand, so a running maximum
//! built on it forgets every NaN, and a `d.is_nan()` test inside such a fold loses one unless it
//! is last) or one whose length differs
//! from the expected (a `zip` stops at the shorter side).

use std::fmt;

/// Which of the two compared buffers a problem was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The values under test (first argument).
    Actual,
    /// The values they are compared with (second argument).
    Expected,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Actual => "actual",
            Side::Expected => "expected",
        })
    }
}

/// Why two buffers could not be compared; the message names what was found where.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum CompareError {
    /// The buffers have different lengths.
    #[error("length mismatch: {actual} actual values vs {expected} expected")]
    Length {
        /// Values under test.
        actual: usize,
        /// Values expected.
        expected: usize,
    },
    /// A value is NaN or ±infinity (displayed as `NaN`, `inf` or `-inf`).
    #[error("non-finite value {value} at index {index} of the {side} values")]
    NonFinite {
        /// The buffer it is in.
        side: Side,
        /// Its position (the first non-finite one; actual is scanned before expected).
        index: usize,
        /// The value.
        value: f32,
    },
}

/// Largest `|actual[i] − expected[i]|` over all positions.
///
/// Fails — an error, never a number a `<=` check could let through — when the lengths differ or
/// when any value on either side is NaN or ±infinity (two equal infinities included: an output
/// that overflowed is wrong whatever it is compared with). Empty buffers give 0. Differences
/// are taken in f64 (exact) and the largest is rounded once to f32; one beyond f32's range
/// comes back as `+inf`, which fails any bound.
pub fn max_abs_diff(actual: &[f32], expected: &[f32]) -> Result<f32, CompareError> {
    if actual.len() != expected.len() {
        return Err(CompareError::Length {
            actual: actual.len(),
            expected: expected.len(),
        });
    }
    check_finite(actual, Side::Actual)?;
    check_finite(expected, Side::Expected)?;
    let worst = largest(
        actual
            .iter()
            .zip(expected)
            .map(|(&a, &e)| (f64::from(a) - f64::from(e)).abs()),
    );
    Ok(worst as f32)
}

/// Largest `|v|` (the scale a relative bound is taken against); fails like [`max_abs_diff`] on
/// a non-finite value. Empty gives 0.
pub fn max_abs(values: &[f32]) -> Result<f32, CompareError> {
    check_finite(values, Side::Actual)?;
    Ok(largest(values.iter().map(|&v| f64::from(v).abs())) as f32)
}

/// The largest of `values` (0 for none). A NaN, once seen, is the result: unlike `max`, this
/// running maximum never forgets one (the callers have already refused non-finite inputs, so
/// this only keeps a future caller from folding a NaN away).
fn largest(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |worst, d| {
        if worst.is_nan() || d.is_nan() || d > worst {
            if worst.is_nan() { worst } else { d }
        } else {
            worst
        }
    })
}

fn check_finite(values: &[f32], side: Side) -> Result<(), CompareError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(CompareError::NonFinite {
            side,
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_equal_length_gives_the_largest_difference() {
        assert_eq!(max_abs_diff(&[], &[]), Ok(0.0));
        assert_eq!(max_abs_diff(&[1.0, -2.0, 3.0], &[1.0, -2.5, 3.25]), Ok(0.5));
        assert_eq!(max_abs_diff(&[f32::MAX], &[-f32::MAX]), Ok(f32::INFINITY));
        assert_eq!(max_abs(&[0.5, -4.0, 2.0]), Ok(4.0));
    }

    /// NaN, +inf and -inf at the first, a middle and the last position, on either side: each
    /// is an error naming the side, the position and the value.
    #[test]
    fn any_non_finite_value_anywhere_is_an_error() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for index in [0, 2, 4] {
                let clean = [1.0f32; 5];
                let mut dirty = clean;
                dirty[index] = bad;
                for (a, e, side) in [
                    (&dirty, &clean, Side::Actual),
                    (&clean, &dirty, Side::Expected),
                ] {
                    let err = max_abs_diff(a, e).unwrap_err();
                    let CompareError::NonFinite {
                        side: s,
                        index: i,
                        value,
                    } = err
                    else {
                        panic!("{err}");
                    };
                    assert_eq!((s, i), (side, index));
                    assert!(value.is_nan() == bad.is_nan() && (bad.is_nan() || value == bad));
                }
                // Both sides equally non-finite: still an error.
                assert!(max_abs_diff(&dirty, &dirty).is_err());
                assert!(max_abs(&dirty).is_err());
            }
        }
        let msg = max_abs_diff(&[0.0, f32::NAN], &[0.0, 0.0])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("NaN") && msg.contains("index 1"), "{msg}");
        let msg = max_abs_diff(&[f32::NEG_INFINITY], &[0.0])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("-inf"), "{msg}");
    }

    /// The running maximum keeps a NaN wherever it appears (first, middle, last).
    #[test]
    fn largest_never_forgets_a_nan() {
        for at in 0..3 {
            let mut v = [1.0f64, 2.0, 3.0];
            v[at] = f64::NAN;
            assert!(largest(v.into_iter()).is_nan(), "NaN at {at} forgotten");
        }
        assert_eq!(largest([1.0f64, 3.0, 2.0].into_iter()), 3.0);
        assert_eq!(largest(std::iter::empty()), 0.0);
    }

    #[test]
    fn a_length_mismatch_is_an_error_even_when_the_common_part_agrees() {
        assert_eq!(
            max_abs_diff(&[1.0, 2.0], &[1.0, 2.0, 3.0]),
            Err(CompareError::Length {
                actual: 2,
                expected: 3
            })
        );
        assert!(max_abs_diff(&[1.0], &[]).is_err());
        let msg = max_abs_diff(&[1.0], &[]).unwrap_err().to_string();
        assert!(
            msg.contains("1 actual") && msg.contains("0 expected"),
            "{msg}"
        );
    }
}
