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
