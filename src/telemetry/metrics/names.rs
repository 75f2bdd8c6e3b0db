//! Metric/label name validation and value escaping for the text format.

use std::borrow::Cow;
use std::fmt::Write as _;

/// True if `name` matches `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn is_valid_metric_name(name: &str) -> bool {
    is_valid(name, true)
}

/// True if `name` matches `[a-zA-Z_][a-zA-Z0-9_]*` and does not start with
/// the reserved `__`.
pub fn is_valid_label_name(name: &str) -> bool {
    is_valid(name, false) && !name.starts_with("__")
}

fn is_valid(name: &str, colon_ok: bool) -> bool {
    let mut chars = name.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' || (colon_ok && c == ':') => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon_ok && c == ':'))
}

/// `name` with every invalid character replaced by `_` (and a `_` prefix if
/// it starts with a digit or is empty).
pub fn sanitize_metric_name(name: &str) -> Cow<'_, str> {
    sanitize(name, true)
}

/// Like [`sanitize_metric_name`] for label names (no `:` allowed).
pub fn sanitize_label_name(name: &str) -> Cow<'_, str> {
    sanitize(name, false)
}

fn sanitize(name: &str, colon_ok: bool) -> Cow<'_, str> {
    if is_valid(name, colon_ok) {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 1);
    if name.chars().next().is_none_or(|c| c.is_ascii_digit()) {
        out.push('_');
    }
    out.extend(name.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '_' || (colon_ok && c == ':') {
            c
        } else {
            '_'
        }
    }));
    Cow::Owned(out)
}

/// Append `v` escaped as a label value (`\` → `\\`, `"` → `\"`, newline →
/// `\n`).
pub fn push_label_value(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Append `v` escaped as HELP text (`\` → `\\`, newline → `\n`).
pub fn push_help(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Append `v` as a sample value (`NaN`, `+Inf`, `-Inf` or a Go-parsable
/// float).
pub fn push_f64(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        // Display never uses exponent notation and round-trips.
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(is_valid_metric_name("kvferry_sender_bytes_total"));
        assert!(is_valid_metric_name("a:b_c9"));
        assert!(is_valid_metric_name("_x"));
        assert!(!is_valid_metric_name(""));
        assert!(!is_valid_metric_name("9a"));
        assert!(!is_valid_metric_name("a-b"));
        assert!(!is_valid_metric_name("a b"));
        assert!(is_valid_label_name("stage"));
        assert!(!is_valid_label_name("a:b"));
        assert!(!is_valid_label_name("__reserved"));
        assert!(!is_valid_label_name("é"));
    }

    #[test]
    fn sanitizing() {
        assert!(matches!(sanitize_metric_name("ok_name"), Cow::Borrowed(_)));
        assert_eq!(sanitize_metric_name("a-b.c d"), "a_b_c_d");
        assert_eq!(sanitize_metric_name("9lives"), "_9lives");
        assert_eq!(sanitize_metric_name(""), "_");
        assert_eq!(sanitize_metric_name("ümlaut:x"), "_mlaut:x");
        assert_eq!(sanitize_label_name("a:b"), "a_b");
        for s in ["a-b", "9", "", "x y", "ü"] {
            assert!(is_valid_metric_name(&sanitize_metric_name(s)), "{s}");
        }
    }

    #[test]
    fn escaping() {
        let mut s = String::new();
        push_label_value(&mut s, "a\\b\"c\nd");
        assert_eq!(s, r#"a\\b\"c\nd"#);
        let mut h = String::new();
        push_help(&mut h, "x\\y\"z\nw");
        assert_eq!(h, r#"x\\y"z\nw"#);
    }

    #[test]
    fn floats() {
        let f = |v: f64| {
            let mut s = String::new();
            push_f64(&mut s, v);
            s
        };
        assert_eq!(f(f64::NAN), "NaN");
        assert_eq!(f(f64::INFINITY), "+Inf");
        assert_eq!(f(f64::NEG_INFINITY), "-Inf");
        assert_eq!(f(1.5), "1.5");
        assert_eq!(f(3.0), "3");
        assert_eq!(f(-0.25), "-0.25");
    }
}
