//! Run-time options, from one declarative table (compiler-rt's
//! `asan_flags.inc` pattern): each row gives the name, type, default and help;
//! the parser and the help text both come from it.
//!
//! Options are read from `KVSAN_OPTIONS`, `key=value` items separated by `:`:
//!
//! ```text
//! KVSAN_OPTIONS=on_violation=report:report_format=both:log_path=/tmp/kvsan
//! ```

use std::fmt::Write as _;

use crate::error::SanitizerError;

/// The environment variable options are read from.
pub const OPTIONS_ENV: &str = "KVSAN_OPTIONS";

/// What a violation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnViolation {
    /// Write the report and tell the engine to abort the request (`Verdict::Abort`).
    Abort,
    /// Write the report, then exit the process with `exitcode`.
    Halt,
    /// Write the report and let the request go on (`Verdict::Continue`).
    Report,
}

/// Which report forms are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportFormat {
    /// The human, AddressSanitizer-style block.
    Text,
    /// One JSON line.
    Json,
    /// The human block followed by the JSON line.
    Both,
}

/// A type an option can have: parsed from the option string, rendered for help.
pub trait OptionValue: Sized {
    /// What the type accepts, for help and error messages.
    fn allowed() -> String;
    /// Parses a value; `None` if it is not allowed.
    fn parse_value(text: &str) -> Option<Self>;
    /// Renders a value the way the parser accepts it.
    fn render(&self) -> String;
}

macro_rules! keyword_option {
    ($ty:ty { $($variant:ident => $word:literal),* $(,)? }) => {
        impl OptionValue for $ty {
            fn allowed() -> String {
                [$($word),*].join("|")
            }
            fn parse_value(text: &str) -> Option<Self> {
                match text { $($word => Some(<$ty>::$variant),)* _ => None }
            }
            fn render(&self) -> String {
                match self { $(<$ty>::$variant => $word.to_string(),)* }
            }
        }
    };
}

/// Which requests the prefix cache may share a page with, as the engine's
/// `--prefix-cache` policy says (vLLM's automatic prefix caching is
/// `salt`; SGLang's radix cache `global`).
///
/// A salt always narrows sharing under `tenant` and `salt`: a page carries
/// the salt its writer declared ([`crate::Sanitizer::declare_salt`]; none
/// is 0), and only a sharer that declared the same salt may take it. The
/// prefix cache's own reference to a page it keeps
/// ([`crate::RequestId::PREFIX_CACHE`]) is not held to the policy: it
/// never reads, and each request it shares the page with is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharePolicy {
    /// No sharing: every share is a violation.
    Off,
    /// Only requests of the tenant whose request wrote the page, with the
    /// page's salt (unsalted requests share unsalted pages).
    Tenant,
    /// Only requests that declared the writer's cache salt
    /// ([`crate::Sanitizer::declare_salt`]); requests without a salt share
    /// among themselves, as vLLM's `cache_salt` does.
    Salt,
    /// Any request.
    Global,
}

keyword_option!(OnViolation { Abort => "abort", Halt => "halt", Report => "report" });
keyword_option!(SharePolicy { Off => "off", Tenant => "tenant", Salt => "salt", Global => "global" });
keyword_option!(ReportFormat { Text => "text", Json => "json", Both => "both" });

impl OptionValue for bool {
    fn allowed() -> String {
        "true|false|1|0".to_string()
    }
    fn parse_value(text: &str) -> Option<Self> {
        match text {
            "true" | "1" => Some(true),
            "false" | "0" => Some(false),
            _ => None,
        }
    }
    fn render(&self) -> String {
        self.to_string()
    }
}

macro_rules! integer_option {
    ($($ty:ty),*) => {$(
        impl OptionValue for $ty {
            fn allowed() -> String {
                format!("an integer from {} to {}", <$ty>::MIN, <$ty>::MAX)
            }
            fn parse_value(text: &str) -> Option<Self> {
                text.parse().ok()
            }
            fn render(&self) -> String {
                self.to_string()
            }
        }
    )*};
}

integer_option!(i32, u32);

impl OptionValue for String {
    fn allowed() -> String {
        "a path (empty: stderr)".to_string()
    }
    fn parse_value(text: &str) -> Option<Self> {
        Some(text.to_string())
    }
    fn render(&self) -> String {
        self.clone()
    }
}

/// One row of the options table, for help text and tooling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionSpec {
    /// The key in `KVSAN_OPTIONS`.
    pub name: &'static str,
    /// What values it accepts.
    pub allowed: String,
    /// Its default, rendered.
    pub default: String,
    /// What it does.
    pub help: &'static str,
}

macro_rules! declare_options {
    ($($name:ident : $ty:ty = $default:expr, $help:literal;)*) => {
        /// The sanitizer's options. Build with [`Options::default`],
        /// [`Options::parse`] or [`Options::from_env`].
        #[derive(Clone, Debug, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct Options {
            $(
                #[doc = $help]
                pub $name: $ty,
            )*
        }

        impl Default for Options {
            fn default() -> Options {
                Options { $($name: $default,)* }
            }
        }

        impl Options {
            /// Every option: name, allowed values, default, help.
            #[must_use]
            pub fn table() -> Vec<OptionSpec> {
                let defaults = Options::default();
                vec![$(OptionSpec {
                    name: stringify!($name),
                    allowed: <$ty as OptionValue>::allowed(),
                    default: defaults.$name.render(),
                    help: $help,
                }),*]
            }

            /// Sets one option from its text value.
            ///
            /// # Errors
            /// [`SanitizerError::UnknownOption`] or [`SanitizerError::BadOptionValue`].
            pub fn set(&mut self, key: &str, value: &str) -> Result<(), SanitizerError> {
                match key {
                    $(stringify!($name) => {
                        self.$name = <$ty as OptionValue>::parse_value(value).ok_or_else(|| {
                            SanitizerError::BadOptionValue {
                                key: key.to_string(),
                                value: value.to_string(),
                                allowed: <$ty as OptionValue>::allowed(),
                            }
                        })?;
                        Ok(())
                    })*
                    _ => Err(SanitizerError::UnknownOption {
                        key: key.to_string(),
                        known: [$(stringify!($name)),*].join(", "),
                    }),
                }
            }
        }
    };
}

declare_options! {
    on_violation: OnViolation = OnViolation::Abort,
        "What a violation does: `abort` the request (Verdict::Abort), `halt` the process with `exitcode`, or `report` only (Verdict::Continue).";
    exitcode: i32 = 23,
        "Exit status of the process when `on_violation=halt`.";
    log_path: String = String::new(),
        "Write reports to `<log_path>.<pid>` instead of stderr (empty: stderr).";
    report_format: ReportFormat = ReportFormat::Text,
        "Report form: `text` (human block), `json` (one JSON line), or `both`.";
    history_depth: u32 = 5,
        "Events kept per page in its origin history ring (alloc, first write, send, recv, commit, share, free).";
    quarantine_pages: u32 = 0,
        "Freed pages held Quarantined per pool (FIFO) before they count as Free; 0 (the default) keeps the release engine's reuse order, and generations still catch a use after free.";
    poison: bool = false,
        "Ask the engine to fill freed pages with a poison pattern (debug-build engine mode; the sanitizer itself never sees KV bytes); off by default, so a stale read returns what it returns in production.";
    print_limit: u32 = 100,
        "Reports printed at most (0: no limit); counting goes on after the limit.";
    max_recorded: u32 = 1024,
        "Recent violations kept in memory for Sanitizer::violations (oldest dropped first).";
    prefix_share: SharePolicy = SharePolicy::Tenant,
        "Which requests the prefix cache may share a page with: `off` none, `tenant` the writer's tenant with the writer's cache salt (unsalted with unsalted), `salt` requests that declared the writer's cache salt (unsalted ones share among themselves), `global` any.";
    self_test: bool = false,
        "At start, provoke one violation of each kind the sanitizer checks on scratch pools of a private sanitizer with these options, and refuse to start (naming the kind) if one is not caught.";
    ended_requests: u32 = 65_536,
        "Ended requests remembered (their final states), so activity after a request's end is still caught; older ones are forgotten and the sanitizer's memory does not grow with the requests served.";
}

impl Options {
    /// Parses `key=value:key=value` over the defaults. Empty items are skipped.
    ///
    /// # Errors
    /// The first unknown key, bad value or item without `=`.
    pub fn parse(text: &str) -> Result<Options, SanitizerError> {
        let mut options = Options::default();
        for item in text.split(':').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) =
                item.split_once('=')
                    .ok_or_else(|| SanitizerError::MalformedOption {
                        item: item.to_string(),
                    })?;
            options.set(key.trim(), value.trim())?;
        }
        Ok(options)
    }

    /// Parses `KVSAN_OPTIONS` (defaults if unset).
    ///
    /// # Errors
    /// As [`Options::parse`].
    pub fn from_env() -> Result<Options, SanitizerError> {
        match std::env::var(OPTIONS_ENV) {
            Ok(text) => Options::parse(&text),
            Err(_) => Ok(Options::default()),
        }
    }

    /// The help text: one paragraph per option, from the table.
    #[must_use]
    pub fn help() -> String {
        let mut out = format!("{OPTIONS_ENV} options (key=value, separated by ':'):\n");
        for spec in Options::table() {
            let _ = writeln!(
                out,
                "  {:<17} {} (default: {})\n      {}",
                spec.name,
                spec.allowed,
                if spec.default.is_empty() {
                    "\"\""
                } else {
                    &spec.default
                },
                spec.help
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_colon_separated_items_over_defaults() {
        let o = Options::parse(
            "on_violation=halt:exitcode=7:report_format=both:history_depth=9:poison=1",
        )
        .unwrap();
        assert_eq!(o.on_violation, OnViolation::Halt);
        assert_eq!(o.exitcode, 7);
        assert_eq!(o.report_format, ReportFormat::Both);
        assert_eq!(o.history_depth, 9);
        assert!(o.poison);
        assert_eq!(o.quarantine_pages, Options::default().quarantine_pages);
    }

    #[test]
    fn by_default_freed_pages_are_reused_as_in_production() {
        let o = Options::default();
        assert_eq!(o.quarantine_pages, 0);
        assert!(!o.poison);
    }

    #[test]
    fn unknown_key_names_the_key_and_the_known_ones() {
        let err = Options::parse("on_violaton=abort").unwrap_err().to_string();
        assert!(err.contains("`on_violaton`"), "{err}");
        assert!(err.contains("on_violation, exitcode"), "{err}");
    }

    #[test]
    fn bad_value_names_the_key_and_the_allowed_values() {
        let err = Options::parse("on_violation=explode")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`explode`") && err.contains("`on_violation`"),
            "{err}"
        );
        assert!(err.contains("abort|halt|report"), "{err}");
        let err = Options::parse("print_limit=-1").unwrap_err().to_string();
        assert!(err.contains("an integer from 0 to 4294967295"), "{err}");
    }

    #[test]
    fn item_without_equals_is_rejected() {
        let err = Options::parse("halt").unwrap_err().to_string();
        assert!(err.contains("`halt` is not of the form key=value"), "{err}");
    }

    #[test]
    fn help_lists_every_option_with_its_default() {
        let help = Options::help();
        for spec in Options::table() {
            assert!(help.contains(spec.name), "{}", spec.name);
        }
        assert!(
            help.contains("abort|halt|report (default: abort)"),
            "{help}"
        );
    }
}
