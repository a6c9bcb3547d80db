//! A secret given on the command line or in the environment (API keys, the admin key, the
//! cluster secret): its `Debug` prints nothing of it, so a `?args` in a log line leaks nothing.

/// The text of a secret; read it with [`Secret::expose`].
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn debug_hides_the_text() {
        let s: super::Secret = "sk-very-secret".parse().unwrap_or_else(|e| match e {});
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert_eq!(s.expose(), "sk-very-secret");
    }
}
