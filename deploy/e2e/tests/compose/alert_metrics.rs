//! The metric names the alert rules (deploy/prometheus/alerts.yml) select, read from their PromQL
//! expressions, for the compose test that scrapes every running service and looks for each.
//!
//! A small extractor rather than a PromQL parser: the rules use selectors, aggregations, binary
//! operators with `on`/`group_left`, `offset` and functions, nothing exotic. It drops, in order:
//! string literals (regexes and `label_replace` arguments), label matchers (`{...}`), range and
//! subquery durations (`[...]`), the label lists of `by`, `without`, `on`, `ignoring`,
//! `group_left` and `group_right`, and numbers and durations; of the identifiers left, a name
//! followed by `(` is a function or aggregation and a keyword is an operator or modifier: the rest
//! are metric names. [`alert_metric_names`] checks its own result against the rules' text (every name
//! found appears in it as a selector).

use std::collections::BTreeSet;

use yaml_rust2::YamlLoader;

/// PromQL's keywords: set operators, the modifiers (their label lists are dropped before), `offset`,
/// `bool`, `@`'s `start`/`end`, and the aggregation operators (`sum by (x) (...)`: not followed by
/// `(` themselves).
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "atan2",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "start",
    "end",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// Each alert's name with the metric names its expression selects, in the rules' order.
pub fn alert_metric_names(rules_yaml: &str) -> Vec<(String, BTreeSet<String>)> {
    let docs = YamlLoader::load_from_str(rules_yaml).expect("alerts.yml is YAML");
    let mut out = Vec::new();
    for group in docs[0]["groups"].as_vec().expect("alerts.yml has groups") {
        for rule in group["rules"].as_vec().expect("a group has rules") {
            let name = rule["alert"].as_str().or_else(|| rule["record"].as_str()).expect("a rule is an alert or a recording rule");
            let expr = rule["expr"].as_str().expect("a rule has an expression");
            let names = metric_names(expr);
            for n in &names {
                assert!(expr.contains(n.as_str()), "{name}: {n} is not in its expression");
            }
            assert!(!names.is_empty(), "{name}: no metric name found in {expr}");
            out.push((name.to_string(), names));
        }
    }
    out
}

/// The metric names a PromQL expression selects (see the module's documentation).
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let s = strip_strings(expr);
    let s = strip_between(&s, '{', '}');
    let s = strip_between(&s, '[', ']');
    let s = strip_label_lists(&s);
    let chars: Vec<char> = s.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_ascii_digit() || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit)) {
            // A number or a duration (`30m`, `1.5e3`): skipped whole.
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.' || chars[i] == '_') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            let is_function = next == Some(&'(');
            if !is_function && !KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The expression without its string literals (`"..."`, `'...'`, `` `...` ``, escapes honoured).
fn strip_strings(expr: &str) -> String {
    let mut out = String::new();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    for c in expr.chars() {
        match quote {
            Some(q) => {
                if escaped {
                    escaped = false;
                } else if c == '\\' && q != '`' {
                    escaped = true;
                } else if c == q {
                    quote = None;
                    out.push_str("\"\"");
                }
            }
            None if matches!(c, '"' | '\'' | '`') => quote = Some(c),
            None => out.push(c),
        }
    }
    out
}

/// The expression with what is between `open` and `close` dropped (the brackets kept; not nested).
fn strip_between(s: &str, open: char, close: char) -> String {
    let mut out = String::new();
    let mut inside = false;
    for c in s.chars() {
        if c == open {
            inside = true;
            out.push(c);
        } else if c == close && inside {
            inside = false;
            out.push(c);
        } else if !inside {
            out.push(c);
        }
    }
    out
}

/// The expression without the label lists of the grouping and matching modifiers: `by (a, b)` ->
/// `by ()`.
fn strip_label_lists(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    'outer: while !rest.is_empty() {
        for kw in ["by", "without", "on", "ignoring", "group_left", "group_right"] {
            let at_word_start = !out.chars().last().is_some_and(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':');
            if at_word_start && rest.starts_with(kw) {
                let after = &rest[kw.len()..];
                if let Some(list) = after.trim_start().strip_prefix('(') {
                    if let Some(end) = list.find(')') {
                        out.push_str(kw);
                        out.push_str(" ()");
                        rest = &list[end + 1..];
                        continue 'outer;
                    }
                }
            }
        }
        let c = rest.chars().next().expect("not empty");
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// The extractor on the rules' own shapes (run by the compose binary without Docker: `cargo test -p
/// fleet-e2e --test compose -- rules`).
pub fn self_check() {
    let got = metric_names(r#"(up == 0) * on(job, instance) group_left(service) group by (job, instance, service) (last_over_time(fleet_build_info[6h]))"#);
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["fleet_build_info", "up"]);
    let got = metric_names(
        r#"sum by (queue) (increase(listener_received_total{queue=~".+-dlq(\\.fifo)?"}[15m]) unless on(job, instance, queue)
             label_replace(listener_received_total, "queue", "$1-dlq$2", "queue", "(.+?)(\\.fifo)?")) > 0"#,
    );
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["listener_received_total"]);
    let got = metric_names("(max(controller_open_jobs) > 0) and on() (time() - max(controller_last_result_timestamp_seconds) > 900)");
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["controller_last_result_timestamp_seconds", "controller_open_jobs"]);
    let got = metric_names("(increase(a_total[30m]) and a_total offset 30m) or (b_total unless b_total offset 1h30m) > 1.5e3");
    assert_eq!(got.into_iter().collect::<Vec<_>>(), ["a_total", "b_total"]);
}
