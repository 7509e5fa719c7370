//! Exact decimal quantities. No floating point anywhere on this path: the
//! JSON number's own text is parsed, so `0.001`, `"0.001"` and `1e-3` are the
//! same exact value.

use rust_decimal::Decimal;

/// Longest quantity text accepted; longer text is not a plausible quantity.
pub const MAX_QUANTITY_TEXT: usize = 64;

/// Why a quantity's text is not an exact decimal we can hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("not a decimal number: {0:?}")]
    Syntax(String),
    #[error("{0:?} has more than 28 significant decimal places or exceeds 96 bits")]
    OutOfRange(String),
}

/// Parses JSON number grammar (`-? int frac? exp?`, no leading zeros, no `+`)
/// into a normalised exact decimal.
pub fn parse_decimal(text: &str) -> Result<Decimal, QuantityError> {
    match plain_integer(text) {
        Some(value) => Ok(value),
        None => parse_any(text),
    }
}

/// A whole number of at most 19 digits without sign, point, exponent or
/// leading zero (the string `"12"` or the number `0`): the usual quantity, read into a `u64` with
/// none of the general path's work (a digit string built, an `i128` per
/// digit, normalising: 3% of the offline path's instructions). The value is
/// the one [`parse_any`] gives; anything else is left to it.
fn plain_integer(text: &str) -> Option<Decimal> {
    let b = text.as_bytes();
    if b.is_empty() || b.len() > 19 || (b.len() > 1 && b[0] == b'0') {
        return None;
    }
    let mut value: u64 = 0;
    for &d in b {
        if !d.is_ascii_digit() {
            return None;
        }
        // 19 digits stay below u64::MAX (1.8e19).
        value = value * 10 + u64::from(d - b'0');
    }
    Some(Decimal::from(value))
}

/// Any text of the JSON number grammar; see [`parse_decimal`].
fn parse_any(text: &str) -> Result<Decimal, QuantityError> {
    let syntax = || QuantityError::Syntax(truncate_for_detail(text));
    let range = || QuantityError::OutOfRange(truncate_for_detail(text));
    if text.len() > MAX_QUANTITY_TEXT {
        return Err(range());
    }
    let b = text.as_bytes();
    let mut i = 0;
    let negative = b.first() == Some(&b'-');
    if negative {
        i += 1;
    }
    let int_start = i;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let int_digits = &text[int_start..i];
    if int_digits.is_empty() || (int_digits.len() > 1 && int_digits.starts_with('0')) {
        return Err(syntax());
    }
    let mut frac_digits = "";
    if i < b.len() && b[i] == b'.' {
        i += 1;
        let s = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        frac_digits = &text[s..i];
        if frac_digits.is_empty() {
            return Err(syntax());
        }
    }
    let mut exponent: i64 = 0;
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        i += 1;
        let mut exp_negative = false;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            exp_negative = b[i] == b'-';
            i += 1;
        }
        let s = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &text[s..i];
        if digits.is_empty() {
            return Err(syntax());
        }
        // Bounded by MAX_QUANTITY_TEXT, so at most ~60 digits: saturate.
        let magnitude: i64 = digits.parse().unwrap_or(i64::MAX / 4).min(1_000_000);
        exponent = if exp_negative { -magnitude } else { magnitude };
    }
    if i != b.len() {
        return Err(syntax());
    }

    // value = digits(int ++ frac) * 10^(exponent - frac_len)
    let mut digits: String = String::with_capacity(int_digits.len() + frac_digits.len());
    digits.push_str(int_digits);
    digits.push_str(frac_digits);
    let mut scale: i64 = frac_digits.len() as i64 - exponent;
    // Trailing zeros carry no value; dropping them widens the range we hold.
    while scale > 0 && digits.len() > 1 && digits.ends_with('0') {
        digits.pop();
        scale -= 1;
    }
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Ok(Decimal::ZERO);
    }
    let mut mantissa: i128 = 0;
    for d in digits.bytes() {
        mantissa = mantissa.checked_mul(10).and_then(|m| m.checked_add(i128::from(d - b'0'))).ok_or_else(range)?;
    }
    while scale < 0 {
        mantissa = mantissa.checked_mul(10).ok_or_else(range)?;
        scale += 1;
    }
    if scale > 28 {
        return Err(range());
    }
    if negative {
        mantissa = -mantissa;
    }
    let value = Decimal::try_from_i128_with_scale(mantissa, scale as u32).map_err(|_| range())?;
    Ok(value.normalize())
}

fn truncate_for_detail(text: &str) -> String {
    text.chars().take(40).collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn d(s: &str) -> Decimal {
        parse_decimal(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn number_spellings_of_the_same_value_are_equal() {
        assert_eq!(d("1.5"), d("1.50"));
        assert_eq!(d("1.5"), d("15e-1"));
        assert_eq!(d("1.5"), d("0.15E+1"));
        assert_eq!(d("0.001"), d("1e-3"));
        assert_eq!(d("1000"), d("1e3"));
        assert_eq!(d("0"), d("-0"));
        assert_eq!(d("0"), d("0.000"));
        assert_eq!(d("1.50").to_string(), "1.5");
        assert_eq!(d("-0").to_string(), "0");
        assert_eq!(d("1e3").to_string(), "1000");
    }

    proptest! {
        /// The whole-number path reads what the general path reads, and
        /// declines what it must: leading zeros, signs, points, exponents,
        /// more than 19 digits.
        #[test]
        fn whole_numbers_read_as_the_general_path_reads_them(
            text in prop_oneof![
                any::<u64>().prop_map(|n| n.to_string()),
                "[0-9]{1,21}".prop_map(String::from),
                "-?[0-9]{1,4}(\\.[0-9]{0,3})?([eE][-+]?[0-9]{1,2})?",
                "[0-9 +.a]{0,4}",
            ]
        ) {
            let fast = plain_integer(&text);
            let general = parse_any(&text);
            if let Some(v) = fast {
                prop_assert_eq!(Ok(v), general.clone(), "{}", text);
                let representation = general.map(|g| (g.mantissa(), g.scale())).unwrap_or_default();
                prop_assert_eq!((v.mantissa(), v.scale()), representation);
            }
            prop_assert_eq!(parse_decimal(&text), parse_any(&text));
        }
    }

    #[test]
    fn the_whole_number_path_declines_what_is_not_one() {
        for text in ["00", "007", "-0", "-1", "1e3", "1.0", "", "+1", "12345678901234567890"] {
            assert!(plain_integer(text).is_none(), "{text:?}");
        }
        assert_eq!(plain_integer("1234567890123456789"), Some(Decimal::from(1_234_567_890_123_456_789u64)));
    }

    #[test]
    fn different_values_differ() {
        assert_ne!(d("1.5"), d("1.05"));
        assert_ne!(d("0.1"), d("0.10000000000000001"));
    }

    #[test]
    fn no_float_rounding() {
        // 0.1 + 0.2 style values keep every digit.
        assert_eq!(d("0.30000000000000004").to_string(), "0.30000000000000004");
        assert_eq!(d("12345678901234567890.123456789").to_string(), "12345678901234567890.123456789");
    }

    #[test]
    fn bad_syntax_is_rejected() {
        for s in ["", "-", "01", "1.", ".5", "1e", "1e+", "+1", "1,5", "NaN", "inf", "0x10", " 1", "1 ", "--1", "1.2.3"]
        {
            assert!(matches!(parse_decimal(s), Err(QuantityError::Syntax(_))), "{s:?}");
        }
    }

    #[test]
    fn out_of_range_is_rejected() {
        for s in ["1e100", "1e-100", "99999999999999999999999999999999", "0.00000000000000000000000000001"] {
            assert!(matches!(parse_decimal(s), Err(QuantityError::OutOfRange(_))), "{s:?}");
        }
        let long = "1".repeat(MAX_QUANTITY_TEXT + 1);
        assert!(matches!(parse_decimal(&long), Err(QuantityError::OutOfRange(_))));
    }
}
