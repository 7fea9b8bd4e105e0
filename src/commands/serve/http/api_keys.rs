//! Tenants from API keys: `--api-keys FILE` maps each key a client sends as
//! `Authorization: Bearer KEY` to the tenant that pays for its requests. A
//! client never chooses its tenant.
//!
//! ```text
//!  # comment                 blank lines and `#` comments are ignored
//!  KEY TENANT [SALT]         TENANT: a number (0 ..= 4294967295);
//!  sk-alpha 1                SALT: the key's server-side prefix-cache salt:
//!  sk-beta  2 s3cr3t         its requests share cached pages only with
//!                            requests of the same salt
//! ```
//!
//! A malformed line, or a key given twice, refuses to start, naming the line.
//! Neither a key nor a salt is ever logged or echoed (`Debug` leaves them out).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use anyhow::{Context, bail};
use kvsan_sanitizer::TenantId;

/// Longest cache salt accepted (`cache_salt`, a keys file's third
/// column), in bytes.
pub(super) const MAX_CACHE_SALT_BYTES: usize = 1024;

/// The tenant a key maps to.
#[derive(Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Who pays.
    pub id: TenantId,
    /// The server-side prefix-cache salt of the third column (the
    /// request's `CacheSalt::server`).
    pub salt: Option<String>,
}

impl fmt::Debug for Tenant {
    /// The tenant, and whether it has a salt — never the salt.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenant")
            .field("id", &self.id)
            .field("salted", &self.salt.is_some())
            .finish()
    }
}

/// Who a request is from.
pub enum Tenants {
    /// No `--api-keys`: every client is this one tenant, no key asked.
    Single(Tenant),
    /// Keys to tenants; a request without a known key is refused.
    Keys(HashMap<String, Tenant>),
}

impl fmt::Debug for Tenants {
    /// How many keys — never a key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tenants::Single(t) => f.debug_tuple("Single").field(t).finish(),
            Tenants::Keys(keys) => write!(f, "Keys({} keys)", keys.len()),
        }
    }
}

impl Tenants {
    /// The tenant of a server without `--api-keys`.
    pub fn single() -> Tenants {
        Tenants::Single(Tenant {
            id: TenantId(0),
            salt: None,
        })
    }

    /// Reads `--api-keys FILE`.
    pub fn load(path: &Path) -> anyhow::Result<Tenants> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--api-keys: cannot read {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("--api-keys {}", path.display()))
    }

    fn parse(text: &str) -> anyhow::Result<Tenants> {
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let n = n + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let [key, tenant, rest @ ..] = words.as_slice() else {
                bail!("line {n}: expected `KEY TENANT [SALT]`, found one word");
            };
            if rest.len() > 1 {
                bail!(
                    "line {n}: expected `KEY TENANT [SALT]`, found {} words",
                    words.len()
                );
            }
            let id = tenant.parse::<u32>().map_err(|_| {
                anyhow::anyhow!(
                    "line {n}: the tenant {tenant:?} is not a number from 0 to {}",
                    u32::MAX
                )
            })?;
            if let Some(salt) = rest.first()
                && salt.len() > MAX_CACHE_SALT_BYTES
            {
                bail!(
                    "line {n}: the salt has {} bytes: at most {MAX_CACHE_SALT_BYTES} are allowed",
                    salt.len()
                );
            }
            let entry = Tenant {
                id: TenantId(id),
                salt: rest.first().map(|s| (*s).to_string()),
            };
            if keys.insert((*key).to_string(), entry).is_some() {
                bail!("line {n}: this key is already given on an earlier line");
            }
        }
        if keys.is_empty() {
            bail!("no keys: every request would be refused");
        }
        Ok(Tenants::Keys(keys))
    }

    /// What the server says at start about who its clients are.
    pub fn describe(&self) -> String {
        match self {
            Tenants::Single(t) => format!(
                "no --api-keys: every client is tenant {} and no key is asked",
                t.id.0
            ),
            Tenants::Keys(keys) => {
                let mut tenants: Vec<u32> = keys.values().map(|t| t.id.0).collect();
                tenants.sort_unstable();
                tenants.dedup();
                let salted = keys.values().filter(|t| t.salt.is_some()).count();
                format!(
                    "--api-keys: {} keys for {} tenants ({salted} with a prefix-cache salt)",
                    keys.len(),
                    tenants.len()
                )
            }
        }
    }

    /// The tenant of a request's `Authorization` header value.
    ///
    /// # Errors
    /// The 401 message: no key, not a Bearer key, or an unknown key (the key
    /// itself is never repeated).
    pub fn authorize(&self, authorization: Option<&[u8]>) -> Result<&Tenant, String> {
        let keys = match self {
            Tenants::Single(t) => return Ok(t),
            Tenants::Keys(keys) => keys,
        };
        let value = authorization
            .ok_or("this server needs an API key: send the header `Authorization: Bearer KEY`")?;
        let key = std::str::from_utf8(value)
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or("the Authorization header is not `Bearer KEY`")?;
        keys.get(key)
            .ok_or_else(|| "the API key is not known".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_their_tenants_and_salts() {
        let tenants = Tenants::parse("# keys\n\nsk-a 1\n  sk-b 2 salt-b  \n").unwrap();
        let a = tenants.authorize(Some(b"Bearer sk-a")).unwrap();
        assert_eq!((a.id, a.salt.as_deref()), (TenantId(1), None));
        let b = tenants.authorize(Some(b"Bearer sk-b")).unwrap();
        assert_eq!((b.id, b.salt.as_deref()), (TenantId(2), Some("salt-b")));
    }

    #[test]
    fn an_unknown_or_missing_key_is_refused_without_echoing_it() {
        let tenants = Tenants::parse("sk-a 1\n").unwrap();
        let e = tenants.authorize(Some(b"Bearer sk-guess")).unwrap_err();
        assert!(!e.contains("sk-guess"), "{e}");
        assert!(tenants.authorize(None).is_err());
        assert!(tenants.authorize(Some(b"sk-a")).is_err(), "not Bearer");
    }

    #[test]
    fn a_malformed_line_is_refused_naming_it() {
        for (text, expect) in [
            ("sk-a 1\nsk-b\n", "line 2"),
            ("sk-a one\n", "line 1"),
            ("sk-a 1 salt extra\n", "line 1"),
            ("sk-a 1\n# c\nsk-a 2\n", "line 3"),
            ("sk-a 4294967296\n", "line 1"),
        ] {
            let e = Tenants::parse(text).unwrap_err().to_string();
            assert!(e.contains(expect), "{text:?}: {e}");
        }
        let long = format!("sk-a 1 {}\n", "s".repeat(MAX_CACHE_SALT_BYTES + 1));
        let e = Tenants::parse(&long).unwrap_err().to_string();
        assert!(e.contains("line 1") && !e.contains("sss"), "{e}");
    }

    #[test]
    fn debug_shows_neither_keys_nor_salts() {
        let tenants = Tenants::parse("sk-secret 1 salt-secret\n").unwrap();
        let shown = format!(
            "{tenants:?} {:?}",
            tenants.authorize(Some(b"Bearer sk-secret"))
        );
        assert!(!shown.contains("secret"), "{shown}");
    }

    #[test]
    fn without_a_file_every_client_is_one_tenant() {
        let tenants = Tenants::single();
        assert_eq!(tenants.authorize(None).unwrap().id, TenantId(0));
        assert!(tenants.describe().contains("tenant 0"));
    }
}
