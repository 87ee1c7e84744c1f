//! Token id arrays in engine answers (`/tokenize`'s `tokens`), read fast.
//! Pure.
//!
//! A prompt of 4–8 kB is 1,000–2,000 ids; serde's generic `Vec<u32>` path
//! spent about 100 instructions per id (callgrind, `chat_bench`: a sixth of
//! the router's instructions per request). [`deserialize`] scans the
//! array's text once for the plain shape engines write (unsigned integers,
//! commas, whitespace) and hands anything else to serde, so it accepts and
//! refuses exactly what `Vec<u32>` does.
use serde::de::{Deserialize, Deserializer, Error};
use serde_json::value::RawValue;

/// `deserialize_with` for a `Vec<u32>` member of a JSON answer parsed from
/// a byte slice or string (the member is borrowed as its raw text).
///
/// # Errors
/// What serde gives for `Vec<u32>`: not an array, an element that is not
/// an integer in `0..=u32::MAX`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    let raw = <&'de RawValue>::deserialize(d)?;
    match plain_u32_array(raw.get()) {
        Some(ids) => Ok(ids),
        None => serde_json::from_str(raw.get()).map_err(D::Error::custom),
    }
}

/// The ids of `text`, one JSON value's valid text, when it is an array of
/// unsigned integers that fit `u32`; `None` for any other value.
fn plain_u32_array(text: &str) -> Option<Vec<u32>> {
    let b = text.as_bytes();
    let inner = b.strip_prefix(b"[")?.strip_suffix(b"]")?;
    let mut ids = Vec::with_capacity(inner.len() / 5 + 1);
    // Valid JSON, so digits, commas and whitespace alternate as an array
    // of numbers requires; only a number's other spellings (sign, fraction,
    // exponent) and non-numbers need a refusal here.
    let mut acc: u64 = 0;
    let mut in_number = false;
    for &c in inner {
        match c {
            b'0'..=b'9' => {
                acc = acc * 10 + u64::from(c - b'0');
                if acc > u64::from(u32::MAX) {
                    return None;
                }
                in_number = true;
            }
            b',' | b' ' | b'\n' | b'\r' | b'\t' => {
                if in_number {
                    ids.push(acc as u32);
                    acc = 0;
                    in_number = false;
                }
            }
            _ => return None,
        }
    }
    if in_number {
        ids.push(acc as u32);
    }
    Some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Reply {
        #[serde(deserialize_with = "deserialize")]
        tokens: Vec<u32>,
    }

    #[test]
    fn same_answers_as_serde() {
        for text in [
            "[]",
            "[ ]",
            "[0]",
            "[1,2,3]",
            "[ 1 ,\n2\t, 3 ]",
            "[4294967295]",
            "[4294967296]",
            "[99999999999999999999999]",
            "[-1]",
            "[1.0]",
            "[1e3]",
            "[null]",
            "[\"1\"]",
            "[[1]]",
            "{}",
            "7",
            "null",
        ] {
            let body = format!(r#"{{"count":3,"tokens":{text},"max_model_len":9}}"#);
            let fast = serde_json::from_slice::<Reply>(body.as_bytes()).map(|r| r.tokens);
            let serde = serde_json::from_str::<Vec<u32>>(text);
            match (&fast, &serde) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{text}"),
                (Err(_), Err(_)) => {}
                _ => panic!("{text}: fast {fast:?}, serde {serde:?}"),
            }
        }
    }

    #[test]
    fn a_long_prompt() {
        let ids: Vec<u32> = (0..5_000u32)
            .map(|i| i.wrapping_mul(2_654_435_761))
            .collect();
        let body = format!(r#"{{"tokens":{}}}"#, serde_json::to_string(&ids).unwrap());
        let r: Reply = serde_json::from_slice(body.as_bytes()).unwrap();
        assert_eq!(r.tokens, ids);
    }
}
