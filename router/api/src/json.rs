//! A JSON object kept as its raw members: keys in their order, every value
//! as the exact text received (serde_json's `raw_value`). Pure.
//!
//! Why raw text: serde_json's default float parsing does not round-trip
//! every decimal (`1214.2449693849999` comes back as `1214.244969385`), and
//! a value re-serialized from a `serde_json::Value` also loses the sender's
//! spelling of a number (`1.50`, `1e3`, integers beyond `u64`). The
//! alternatives were serde_json's `arbitrary_precision` (changes
//! `serde_json::Number` for every crate of a build through feature
//! unification and breaks numbers under `#[serde(flatten)]` and untagged
//! enums) and `float_roundtrip` (also unified, and still not text-exact).
//! `raw_value` is additive: it changes nothing for other crates.
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// An object as `(key, raw value)` pairs in the order received.
#[derive(Debug, Clone, Default)]
pub struct RawObject(pub Vec<(String, Box<RawValue>)>);

impl PartialEq for RawObject {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(&other.0)
                .all(|((ka, va), (kb, vb))| ka == kb && va.get() == vb.get())
    }
}

impl RawObject {
    /// Parse a JSON object's text.
    ///
    /// # Errors
    /// The text is not one JSON object.
    pub fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Parse a JSON object's bytes.
    ///
    /// # Errors
    /// The bytes are not one JSON object.
    pub fn parse_slice(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The raw value of the first member named `key`.
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| &**v)
    }

    /// Remove every member named `key`; returns the first one's value.
    pub fn remove(&mut self, key: &str) -> Option<Box<RawValue>> {
        let i = self.0.iter().position(|(k, _)| k == key)?;
        let v = self.0.remove(i);
        self.0.retain(|(k, _)| k != key);
        Some(v.1)
    }

    /// Set `key` to `value` (replacing it in place, or appending it).
    pub fn set(&mut self, key: &str, value: Box<RawValue>) {
        match self.0.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.0.push((key.to_string(), value)),
        }
    }

    /// Set `key` to a serializable value.
    pub fn set_value<T: serde::Serialize + ?Sized>(&mut self, key: &str, value: &T) {
        self.set(key, to_raw(value));
    }

    /// The object's JSON text: members in order, values exactly as held.
    pub fn to_json(&self) -> String {
        String::from_utf8(self.to_json_bytes()).expect("JSON text is UTF-8")
    }

    /// [`RawObject::to_json`] as bytes.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.text_len() + 2);
        out.push(b'{');
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_member(&mut out, k, v);
        }
        out.push(b'}');
        out
    }

    /// Length of the members' text with their separators, bytes (an upper
    /// bound when keys need no escapes; a capacity hint).
    pub fn text_len(&self) -> usize {
        self.0
            .iter()
            .map(|(k, v)| k.len() + v.get().len() + 4)
            .sum()
    }
}

/// Appends `"key":value` to `out`, the key escaped, the value's text as
/// held.
pub fn write_member(out: &mut Vec<u8>, key: &str, value: &RawValue) {
    serde_json::to_writer(&mut *out, key).expect("a string serializes");
    out.push(b':');
    out.extend_from_slice(value.get().as_bytes());
}

/// The raw JSON of a serializable value.
pub fn to_raw<T: serde::Serialize + ?Sized>(value: &T) -> Box<RawValue> {
    serde_json::value::to_raw_value(value).expect("serializable")
}

impl<'de> serde::Deserialize<'de> for RawObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawObject;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<RawObject, A::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(8));
                while let Some((k, v)) = m.next_entry::<String, Box<RawValue>>()? {
                    out.push((k, v));
                }
                Ok(RawObject(out))
            }
        }
        d.deserialize_map(V)
    }
}

impl serde::Serialize for RawObject {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_order_survive_exactly() {
        let text = r#"{"b":1214.2449693849999,"a":[1.50,1e3,18446744073709551616],"c":{"x":-0.0}}"#;
        let o = RawObject::parse(text).unwrap();
        assert_eq!(o.to_json(), text);
        assert_eq!(o.get("b").unwrap().get(), "1214.2449693849999");
    }

    #[test]
    fn remove_and_set() {
        let mut o = RawObject::parse(r#"{"a":1,"k":{"x":2},"z":3}"#).unwrap();
        assert_eq!(o.remove("k").unwrap().get(), r#"{"x":2}"#);
        o.set_value("a", "s\"q");
        o.set_value("n", &5u32);
        assert_eq!(o.to_json(), r#"{"a":"s\"q","z":3,"n":5}"#);
        assert!(RawObject::parse("[1]").is_err());
    }
}
