//! `--config FILE` and `--print-config` for every subcommand (`serve`, `worker`, `bench`, ...).
//!
//! Why this shape: the flags are the one definition of every setting (clap derive, with their
//! environment variables and defaults), so the file is read against them rather than into a
//! second struct that would drift: each key of the file must name a long flag of the
//! subcommand (`kv-pool-ram` or `kv_pool_ram`), and becomes that flag, placed before the command
//! line's own. A flag given on the command line, or set through its environment variable, wins
//! over the file; an unknown key, or a value of the wrong shape, is an error naming the key. A
//! string starting `~/` starts at the home directory.
//! `--print-config` prints the effective setting of every flag as TOML (secrets redacted), each
//! with where it came from, defaults commented out, and exits — a file it prints is a valid
//! `--config`.

use anyhow::{bail, Context as _};
use clap::parser::ValueSource;
use clap::{ArgAction, Command};
use std::ffi::OsString;
use std::path::Path;

/// What to do with the arguments once the file is read.
#[derive(Debug)]
pub(crate) struct Expanded {
    /// The arguments with the file's settings in them.
    pub(crate) args: Vec<OsString>,
    /// `--print-config` was given: print, then exit.
    pub(crate) print: bool,
    /// The long flags the file set.
    pub(crate) from_file: Vec<String>,
}

/// The subcommand's index in `args`, when one is named.
fn subcommand_at(cmd: &Command, args: &[OsString]) -> Option<usize> {
    args.iter().enumerate().skip(1).find_map(|(i, a)| {
        let a = a.to_str()?;
        cmd.get_subcommands().any(|s| s.get_name() == a || s.get_all_aliases().any(|x| x == a)).then_some(i)
    })
}

/// Takes `--config FILE` / `--config=FILE` and `--print-config` out of `args` (after the
/// subcommand) and puts the file's settings in.
pub(crate) fn expand(cmd: &Command, mut args: Vec<OsString>) -> anyhow::Result<Expanded> {
    let Some(at) = subcommand_at(cmd, &args) else {
        return Ok(Expanded { args, print: false, from_file: Vec::new() });
    };
    let name = args[at].to_string_lossy().into_owned();
    let mut file = None;
    let mut print = false;
    let mut i = at + 1;
    while i < args.len() {
        let a = args[i].to_string_lossy().into_owned();
        if a == "--" {
            break;
        }
        if a == "--print-config" {
            print = true;
            args.remove(i);
        } else if a == "--config" {
            args.remove(i);
            anyhow::ensure!(i < args.len(), "--config needs a file");
            file = Some(args.remove(i));
        } else if let Some(f) = a.strip_prefix("--config=") {
            file = Some(OsString::from(f));
            args.remove(i);
        } else {
            i += 1;
        }
    }
    let file = file.or_else(|| std::env::var_os("TOKENPATH_CONFIG").filter(|f| !f.is_empty()));
    let mut from_file = Vec::new();
    if let Some(file) = file {
        // Built, so the global flags (`--template-timeout-s`, ...) are the subcommand's too.
        let mut built = cmd.clone();
        built.build();
        let sub = built.find_subcommand(&name).context("the subcommand")?;
        let given = &args[at + 1..];
        let set = file_args(sub, Path::new(&file), given, |v| std::env::var_os(v).is_some())?;
        from_file = set.iter().filter_map(long_of).collect();
        args.splice(at + 1..at + 1, set);
    }
    Ok(Expanded { args, print, from_file })
}

/// `--name` of `--name` or `--name=value`.
fn long_of(a: &OsString) -> Option<String> {
    let a = a.to_str()?.strip_prefix("--")?;
    Some(a.split('=').next().unwrap_or(a).to_owned())
}

/// The arguments `path`'s settings stand for, for subcommand `sub`: each key a long flag of it,
/// except those the command line (`given`) or the environment (`env_set`) sets already.
fn file_args(
    sub: &Command,
    path: &Path,
    given: &[OsString],
    env_set: impl Fn(&std::ffi::OsStr) -> bool,
) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).with_context(|| format!("{} is not TOML", path.display()))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let Some(arg) = sub
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()) && !matches!(long.as_str(), "help" | "version"))
        else {
            bail!("{}: unknown key `{key}` (tokenpath {} has no --{long})", path.display(), sub.get_name());
        };
        let on_command_line = given.iter().any(|g| {
            let g = g.to_string_lossy();
            g == format!("--{long}")
                || g.starts_with(&format!("--{long}="))
                || arg.get_short().is_some_and(|s| g.starts_with(&format!("-{s}")) && !g.starts_with("--"))
        });
        if on_command_line || arg.get_env().is_some_and(&env_set) {
            continue;
        }
        let flag = format!("--{long}");
        let bad = |want: &str| anyhow::anyhow!("{}: key `{key}` takes {want}", path.display());
        match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(b)) => {
                if *b {
                    out.push(flag.into());
                }
            }
            (ArgAction::SetTrue | ArgAction::SetFalse, _) => return Err(bad("true or false")),
            (ArgAction::Append, toml::Value::Array(items)) => {
                for item in items {
                    out.push(
                        format!("{flag}={}", scalar(item).ok_or_else(|| bad("a list of values"))?).into(),
                    );
                }
            }
            (ArgAction::Set | ArgAction::Append, v) => {
                out.push(format!("{flag}={}", scalar(v).ok_or_else(|| bad("one value"))?).into());
            }
            _ => return Err(bad("nothing (it cannot be set from a file)")),
        }
    }
    Ok(out)
}

/// A TOML value as a flag's text (`None`: not a scalar).
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        // A path in a file may start at the home directory, as it would in a shell.
        toml::Value::String(s) => match (s.strip_prefix("~/"), std::env::var_os("HOME")) {
            (Some(rest), Some(home)) => Some(Path::new(&home).join(rest).to_string_lossy().into_owned()),
            _ => Some(s.clone()),
        },
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Whether a flag holds a secret (its value is never printed).
fn secret(long: &str) -> bool {
    long.split('-').any(|p| matches!(p, "key" | "keys" | "secret" | "token" | "password"))
}

/// The effective configuration of the subcommand `args` name, as TOML: every flag with a value,
/// where it came from, secrets redacted.
pub(crate) fn render(cmd: Command, args: &[OsString], from_file: &[String]) -> anyhow::Result<String> {
    let matches = cmd.clone().try_get_matches_from(args)?;
    let (name, sub_matches) = matches.subcommand().context("--print-config needs a subcommand")?;
    let sub = cmd.find_subcommand(name).context("the subcommand")?;
    let mut out = format!("# tokenpath {name}: the effective configuration (--print-config)\n");
    for arg in sub.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version" | "config" | "print-config") || arg.is_hide_set() {
            continue;
        }
        let id = arg.get_id().as_str();
        let source = match sub_matches.value_source(id) {
            Some(ValueSource::CommandLine) if from_file.iter().any(|f| f == long) => "file",
            Some(ValueSource::CommandLine) => "flag",
            Some(ValueSource::EnvVariable) => "environment",
            Some(ValueSource::DefaultValue) => "default",
            _ => continue,
        };
        let Ok(Some(raw)) = sub_matches.try_get_raw(id) else { continue };
        let values: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
        if secret(long) || values.iter().any(|v| v.contains("://") && v.contains('@')) {
            // Commented out: the printed file is a valid --config that sets no secret.
            out.push_str(&format!("# {long} = <redacted>  # {source}\n"));
            continue;
        }
        let value = if matches!(arg.get_action(), ArgAction::SetTrue | ArgAction::SetFalse) {
            values.first().cloned().unwrap_or_default()
        } else if matches!(arg.get_action(), ArgAction::Append) {
            format!("[{}]", values.iter().map(|v| toml_value(v)).collect::<Vec<_>>().join(", "))
        } else {
            values.first().map(|v| toml_value(v)).unwrap_or_default()
        };
        // Defaults commented out: a printed file sets what was set, and reads back as it is
        // (a default may belong to a flag that needs another, as `--otlp-wait-s` needs
        // `--otlp-listen`).
        let hash = if source == "default" { "# " } else { "" };
        out.push_str(&format!("{hash}{long} = {value}  # {source}\n"));
    }
    Ok(out)
}

/// `v` as a TOML value: a number when it reads back as the same text, else a string.
fn toml_value(v: &str) -> String {
    let same = |back: String| back == v;
    if v.parse::<i64>().is_ok_and(|i| same(i.to_string()))
        || v.parse::<f64>().is_ok_and(|f| f.is_finite() && v.contains('.') && same(f.to_string()))
    {
        v.to_owned()
    } else {
        // A JSON string is a TOML basic string (the same escapes), but for DEL, which TOML wants
        // escaped.
        serde_json::Value::from(v).to_string().replace('\u{7f}', "\\u007F")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::{Arg, Command};

    fn cmd() -> Command {
        Command::new("tokenpath").subcommand(
            Command::new("serve")
                .arg(Arg::new("port").long("port").env("TP_TEST_PORT").default_value("8000"))
                .arg(Arg::new("kv_tokens").long("kv-tokens"))
                .arg(Arg::new("no_prefix_cache").long("no-prefix-cache").action(ArgAction::SetTrue))
                .arg(Arg::new("upstream").long("upstream").action(ArgAction::Append))
                .arg(Arg::new("admin_key").long("admin-key")),
        )
    }

    fn write(text: &str) -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tokenpath-config-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn keys_become_flags_and_the_command_line_and_environment_win() {
        let f = write("port = 9100\nkv_tokens = 4096\nno-prefix-cache = true\nupstream = [\"http://a\", \"http://b\"]\n");
        let sub = cmd().find_subcommand("serve").unwrap().clone();
        let got = file_args(&sub, &f, &os(&["--kv-tokens", "2048"]), |_| false).unwrap();
        // (In key order.)
        assert_eq!(
            got,
            os(&["--no-prefix-cache", "--port=9100", "--upstream=http://a", "--upstream=http://b"])
        );
        let got = file_args(&sub, &f, &[], |v| v == "TP_TEST_PORT").unwrap();
        assert!(!got.contains(&OsString::from("--port=9100")), "the environment wins: {got:?}");
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn unknown_keys_and_wrong_shapes_are_errors_naming_the_key() {
        let sub = cmd().find_subcommand("serve").unwrap().clone();
        for (text, want) in [
            ("prot = 1\n", "unknown key `prot`"),
            ("no-prefix-cache = \"yes\"\n", "key `no-prefix-cache` takes true or false"),
            ("port = [1, 2]\n", "key `port` takes one value"),
            ("[serve]\nport = 1\n", "unknown key `serve`"),
        ] {
            let f = write(text);
            let e = file_args(&sub, &f, &[], |_| false).unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
            let _ = std::fs::remove_file(f);
        }
    }

    #[test]
    fn expand_takes_its_flags_out_and_print_config_redacts_secrets() {
        let f = write("kv-tokens = 4096\nadmin-key = \"s3cret\"\n");
        let args =
            os(&["tokenpath", "serve", "--config", f.to_str().unwrap(), "--print-config", "--port", "1"]);
        let e = expand(&cmd(), args).unwrap();
        assert!(e.print);
        assert_eq!(
            e.args,
            os(&["tokenpath", "serve", "--admin-key=s3cret", "--kv-tokens=4096", "--port", "1"])
        );
        let text = render(cmd(), &e.args, &e.from_file).unwrap();
        assert!(text.contains("kv-tokens = 4096  # file"), "{text}");
        assert!(text.contains("port = 1  # flag"), "{text}");
        assert!(text.contains("# admin-key = <redacted>"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        assert!(text.contains("# no-prefix-cache = false  # default"), "{text}");
        // What it prints is a valid file again (comments and all).
        let back = write(&text);
        let sub = cmd().find_subcommand("serve").unwrap().clone();
        assert!(file_args(&sub, &back, &[], |_| false).is_ok());
        for p in [f, back] {
            let _ = std::fs::remove_file(p);
        }
    }
}
