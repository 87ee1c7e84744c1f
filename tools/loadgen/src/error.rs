//! Typed errors of the load generator.
use std::path::PathBuf;

/// Every failure of the load generator. Input errors name the offending
/// field (a JSON path such as `[3].messages[1].role` or
/// `prompt_input.num_turns.distribution`) and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// A field of the input is missing or has the wrong type/value.
    #[error("input field `{field}`: expected {expected}")]
    Field {
        /// JSON path of the field.
        field: String,
        /// What was expected there.
        expected: String,
    },
    /// The input is not JSON at all.
    #[error("input is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The text files do not hold enough tokens for what the description asks.
    #[error(
        "not enough text for `{field}`: need tokens [{start_tokens}, {end_tokens}) but the text files hold {available_tokens}"
    )]
    NotEnoughText {
        /// The field whose sample needed the text.
        field: String,
        /// First token offset needed.
        start_tokens: usize,
        /// One past the last token offset needed.
        end_tokens: usize,
        /// Tokens available.
        available_tokens: usize,
    },
    /// No usable source files under any of the roots searched.
    #[error("no source files found under {roots}")]
    NoSourceFiles {
        /// The roots searched, comma-separated.
        roots: String,
    },
    /// Bad client configuration (URL, concurrency, …).
    #[error("client configuration `{field}`: {message}")]
    Config {
        /// The configuration field.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The chart could not be drawn.
    #[error("chart: {0}")]
    Chart(String),
}

impl LoadgenError {
    /// Shorthand for [`LoadgenError::Field`].
    pub fn field(field: impl Into<String>, expected: impl Into<String>) -> Self {
        Self::Field {
            field: field.into(),
            expected: expected.into(),
        }
    }

    /// Shorthand for [`LoadgenError::Io`].
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
