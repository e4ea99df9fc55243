//! The README's configuration table kept in step with the flags themselves: every flag of the four
//! binaries that has an environment variable must have a row in a `| env | flag | default | meaning |`
//! table of the README's *Configuration* section, with the same flag and the same default (`—` for
//! none), and every row must name a variable some binary reads. Read through clap's introspection
//! (`CommandFactory::command()`, `Arg::get_env()`, `Arg::get_default_values()`), so a flag added
//! without a row, a default changed in the code (or in the README alone) or a row left behind fails
//! here, with the difference. No stack needed.
//!
//! Each binary's command is its library's `cli::Cli`, the very type its `main.rs` parses.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory};

/// One flag with an environment variable, as a binary defines it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Flag {
    long: String,
    /// `None`: no default.
    default: Option<String>,
}

/// One row (or one of the `/`-separated entries of a row) of the README's table.
#[derive(Debug, Clone)]
struct Row {
    line: usize,
    flag: String,
    default: Option<String>,
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every argument with an environment variable, in `cmd` and its subcommands (built, so that global
/// flags and the defaults of boolean flags are in place), by variable: each binary that reads it,
/// with its flag and default.
fn collect(bin: &str, cmd: &mut Command, into: &mut BTreeMap<String, Vec<(String, Flag)>>) {
    cmd.build();
    walk(bin, cmd, into);
}

fn walk(bin: &str, cmd: &Command, into: &mut BTreeMap<String, Vec<(String, Flag)>>) {
    for arg in cmd.get_arguments() {
        let Some(env) = arg.get_env() else { continue };
        let env = env.to_str().expect("an ASCII variable name").to_string();
        let long = format!("--{}", arg.get_long().unwrap_or_else(|| panic!("{bin}: {env} has no long flag")));
        let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let flag = Flag { long, default: (!defaults.is_empty()).then(|| defaults.join(",")) };
        let seen = into.entry(env).or_default();
        if !seen.iter().any(|(b, f)| b == bin && *f == flag) {
            seen.push((bin.to_string(), flag));
        }
    }
    for sub in cmd.get_subcommands() {
        walk(bin, sub, into);
    }
}

/// The flags of the four binaries, by environment variable.
fn code() -> BTreeMap<String, Vec<(String, Flag)>> {
    let mut all = BTreeMap::new();
    collect("processor", &mut processor::cli::Cli::command(), &mut all);
    collect("controller", &mut controller::cli::Cli::command(), &mut all);
    collect("scaling-agent", &mut scaling_agent::cli::Cli::command(), &mut all);
    collect("initiator", &mut initiator::cli::Cli::command(), &mut all);
    all
}

/// The cells of a table line (`| a | b |`), trimmed.
fn cells(line: &str) -> Option<Vec<String>> {
    let t = line.trim();
    let inner = t.strip_prefix('|')?.strip_suffix('|')?;
    Some(inner.split('|').map(|c| c.trim().to_string()).collect())
}

/// A cell's `/`-separated entries: each a code span (its text) or `—` (none).
fn entries(cell: &str, line: usize, what: &str) -> Result<Vec<Option<String>>, String> {
    cell.split(" / ")
        .map(|e| {
            let e = e.trim();
            if e == "—" {
                Ok(None)
            } else if let Some(v) = e.strip_prefix('`').and_then(|v| v.strip_suffix('`')).filter(|v| !v.contains('`')) {
                Ok(Some(v.to_string()))
            } else {
                Err(format!("README.md:{line}: the {what} cell must be `value` or —, `/`-separated (meanings go in the last column): {cell:?}"))
            }
        })
        .collect()
}

/// The rows of the `| env | flag | default | meaning |` tables under the README's configuration
/// heading (down to the next heading of the same or a higher level), by variable.
fn readme(text: &str) -> Result<BTreeMap<String, Row>, Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.trim_start_matches('#').trim() == "Configuration" && l.starts_with('#'))
        .ok_or_else(|| vec!["README.md has no `Configuration` heading".to_string()])?;
    let level = lines[start].chars().take_while(|&c| c == '#').count();
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with('#') && l.chars().take_while(|&c| c == '#').count() <= level)
        .map_or(lines.len(), |i| start + 1 + i);
    let (mut rows, mut errors, mut tables) = (BTreeMap::new(), Vec::new(), 0);
    let mut in_table = false;
    for (i, l) in lines.iter().enumerate().take(end).skip(start + 1) {
        let n = i + 1;
        let Some(c) = cells(l) else {
            in_table = false;
            continue;
        };
        if c == ["env", "flag", "default", "meaning"] {
            in_table = true;
            tables += 1;
            continue;
        }
        if !in_table || c.iter().all(|x| x.chars().all(|ch| ch == '-' || ch == ':')) {
            continue;
        }
        if c.len() != 4 {
            errors.push(format!("README.md:{n}: a row of 4 cells expected, found {}", c.len()));
            continue;
        }
        let parsed = (entries(&c[0], n, "env"), entries(&c[1], n, "flag"), entries(&c[2], n, "default"));
        let (envs, flags, defaults) = match parsed {
            (Ok(e), Ok(f), Ok(d)) => (e, f, d),
            (e, f, d) => {
                errors.extend([e.err(), f.err(), d.err()].into_iter().flatten());
                continue;
            }
        };
        if envs.len() != flags.len() || envs.len() != defaults.len() {
            errors.push(format!("README.md:{n}: {} variables, {} flags and {} defaults: one of each per `/`", envs.len(), flags.len(), defaults.len()));
            continue;
        }
        for ((env, flag), default) in envs.into_iter().zip(flags).zip(defaults) {
            let (Some(env), Some(flag)) = (env, flag) else {
                errors.push(format!("README.md:{n}: every entry needs a variable and a flag"));
                continue;
            };
            if let Some(old) = rows.insert(env.clone(), Row { line: n, flag, default }) {
                errors.push(format!("README.md:{n}: {env} has a row already (line {})", old.line));
            }
        }
    }
    if tables == 0 {
        errors.push("README.md's Configuration section has no `| env | flag | default | meaning |` table".to_string());
    }
    if errors.is_empty() {
        Ok(rows)
    } else {
        Err(errors)
    }
}

fn shown(d: &Option<String>) -> String {
    d.as_ref().map_or("—".to_string(), |v| format!("`{v}`"))
}

/// What differs between the README's rows and the binaries' flags.
fn differences(rows: &BTreeMap<String, Row>, code: &BTreeMap<String, Vec<(String, Flag)>>) -> Vec<String> {
    let mut out = Vec::new();
    for (env, defs) in code {
        let (bin, flag) = &defs[0];
        if let Some((other, f)) = defs.iter().find(|(_, f)| f != flag) {
            out.push(format!(
                "{env}: {bin} has {} default {}, {other} has {} default {}: one row cannot say both",
                flag.long,
                shown(&flag.default),
                f.long,
                shown(&f.default)
            ));
            continue;
        }
        let bins: Vec<&str> = defs.iter().map(|(b, _)| b.as_str()).collect();
        match rows.get(env) {
            None => out.push(format!(
                "{env} ({}) has no row in the README's configuration table: add | `{env}` | `{}` | {} | ... |",
                bins.join(", "),
                flag.long,
                shown(&flag.default)
            )),
            Some(row) => {
                if row.flag != flag.long {
                    out.push(format!("README.md:{}: {env} is the variable of {} ({}), not of {}", row.line, flag.long, bins.join(", "), row.flag));
                }
                if row.default != flag.default {
                    out.push(format!(
                        "README.md:{}: {env} ({}) defaults to {} in the code, {} in the README",
                        row.line,
                        flag.long,
                        shown(&flag.default),
                        shown(&row.default)
                    ));
                }
            }
        }
    }
    for (env, row) in rows {
        if !code.contains_key(env) {
            out.push(format!("README.md:{}: {env} ({}) is read by no binary: remove the row, or put it in the prose", row.line, row.flag));
        }
    }
    out
}

#[test]
fn the_readme_configuration_table_matches_every_flag() {
    let text = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let rows = readme(&text).unwrap_or_else(|e| panic!("the README's configuration table cannot be read:\n{}", e.join("\n")));
    let code = code();
    assert!(code.len() > 50, "only {} variables found: is the walk broken?", code.len());
    let diff = differences(&rows, &code);
    assert!(diff.is_empty(), "the README's configuration table and the flags differ:\n{}", diff.join("\n"));
}

#[test]
fn the_table_parser_reads_compound_rows_and_refuses_loose_defaults() {
    let text = "## Configuration\n\n| env | flag | default | meaning |\n|---|---|---|---|\n| `A_MIN` / `A_MAX` | `--min` / `--max` | `1` / — | bounds |\n\n## Next\n| env | flag | default | meaning |\n|---|---|---|---|\n| `B` | `--b` | `2` | not read |\n";
    let rows = readme(text).expect("a table");
    assert_eq!(rows.len(), 2);
    assert_eq!(rows["A_MIN"].default.as_deref(), Some("1"));
    assert_eq!(rows["A_MAX"].default, None);
    assert_eq!(rows["A_MAX"].flag, "--max");
    let loose = "## Configuration\n\n| env | flag | default | meaning |\n|---|---|---|---|\n| `A` | `--a` | 1 (one) | x |\n";
    assert!(readme(loose).is_err());
    // A default changed in the code is a difference.
    let code = BTreeMap::from([("A_MIN".to_string(), vec![("x".to_string(), Flag { long: "--min".into(), default: Some("2".into()) })])]);
    let diff = differences(&rows, &code);
    assert!(diff.iter().any(|d| d.contains("defaults to `2` in the code, `1` in the README")), "{diff:?}");
    assert!(diff.iter().any(|d| d.contains("A_MAX") && d.contains("read by no binary")), "{diff:?}");
}

/// Prints the rows the README needs, from the code (`cargo test -p fleet-e2e --test it -- --ignored --nocapture
/// readme_config::print_rows`).
#[test]
#[ignore]
fn print_rows() {
    for (env, defs) in code() {
        let (bins, flag) = (defs.iter().map(|(b, _)| b.as_str()).collect::<Vec<_>>().join(", "), &defs[0].1);
        println!("| `{env}` | `{}` | {} | ({bins}) |", flag.long, shown(&flag.default));
    }
}
