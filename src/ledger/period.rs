//! Billing periods: calendar months in UTC (pure).

use std::fmt;

/// A calendar month, UTC: what an invoice covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Period {
    pub year: i32,
    /// 1..=12
    pub month: u8,
}

impl Period {
    /// Parses `YYYY-MM`, nothing else (no day, no zone: periods are UTC
    /// months, and a looser spelling would hide a typo in a close command).
    pub fn parse(s: &str) -> Result<Period, String> {
        let bad = || format!("{s:?} is not a period: expected YYYY-MM, a calendar month in UTC");
        let (y, m) = s.split_once('-').ok_or_else(bad)?;
        if y.len() != 4 || m.len() != 2 || !y.bytes().chain(m.bytes()).all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let year: i32 = y.parse().map_err(|_| bad())?;
        let month: u8 = m.parse().map_err(|_| bad())?;
        if !(1..=12).contains(&month) || year < 1970 {
            return Err(bad());
        }
        Ok(Period { year, month })
    }

    /// The month `ms` (epoch milliseconds) falls in.
    pub fn of_ms(ms: i64) -> Period {
        let days = ms.div_euclid(86_400_000);
        let (year, month, _) = civil_from_days(days);
        Period { year, month }
    }

    /// First millisecond of the month.
    pub fn start_ms(self) -> i64 {
        days_from_civil(self.year, self.month, 1) * 86_400_000
    }

    /// First millisecond after the month.
    pub fn end_ms(self) -> i64 {
        self.next().start_ms()
    }

    pub fn next(self) -> Period {
        if self.month == 12 {
            Period { year: self.year + 1, month: 1 }
        } else {
            Period { year: self.year, month: self.month + 1 }
        }
    }

    pub fn contains(self, ms: i64) -> bool {
        (self.start_ms()..self.end_ms()).contains(&ms)
    }
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
pub(crate) fn days_from_civil(year: i32, month: u8, day: u8) -> i64 {
    let y = i64::from(year) - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The civil date of a day count since 1970-01-01.
pub(crate) fn civil_from_days(days: i64) -> (i32, u8, u8) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn periods_parse_strictly() {
        assert_eq!(Period::parse("2026-11"), Ok(Period { year: 2026, month: 11 }));
        for bad in ["2026-13", "2026-00", "2026-1", "26-11", "2026/11", "2026-11-01", "", "abcd-ef", "+026-11"] {
            assert!(Period::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn month_bounds_match_the_calendar() {
        let p = Period::parse("2024-02").expect("period");
        assert_eq!(p.start_ms(), 1_706_745_600_000); // 2024-02-01T00:00:00Z
        assert_eq!(p.end_ms() - p.start_ms(), 29 * 86_400_000, "a leap February");
        assert_eq!(Period::parse("2026-12").expect("p").next(), Period { year: 2027, month: 1 });
    }

    proptest! {
        #[test]
        fn every_millisecond_belongs_to_the_period_that_contains_it(ms in 0i64..4_102_444_800_000) {
            let p = Period::of_ms(ms);
            prop_assert!(p.contains(ms));
            let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).expect("time");
            prop_assert_eq!((p.year, p.month), (t.year(), u8::from(t.month())));
            prop_assert_eq!(Period::parse(&p.to_string()), Ok(p));
        }
    }
}
