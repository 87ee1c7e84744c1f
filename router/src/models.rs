//! The models the engines serve: their `/v1/models` answers merged into
//! the router's own (pure).
use std::collections::BTreeMap;

use axum::body::Bytes;
use kvloop_router_api::json::RawObject;

/// Merge the `/v1/models` answers of several engines: one entry per model
/// id (the first engine's members kept exactly), `max_model_len` the
/// smallest any engine reports (a request must fit every engine it may
/// reach). Answers that are not `{"data": [...]}` are ignored.
pub fn merge_models(answers: &[Bytes]) -> (Vec<u8>, Vec<String>) {
    let mut order: Vec<String> = Vec::new();
    let mut models: BTreeMap<String, (RawObject, Option<u64>)> = BTreeMap::new();
    for a in answers {
        let Ok(v) = serde_json::from_slice::<RawObject>(a) else {
            continue;
        };
        let Some(data) = v
            .get("data")
            .and_then(|d| serde_json::from_str::<Vec<RawObject>>(d.get()).ok())
        else {
            continue;
        };
        for m in data {
            let Some(id) = m
                .get("id")
                .and_then(|i| serde_json::from_str::<String>(i.get()).ok())
            else {
                continue;
            };
            let len = m
                .get("max_model_len")
                .and_then(|l| serde_json::from_str::<u64>(l.get()).ok());
            match models.get_mut(&id) {
                Some((_, have)) => {
                    *have = match (*have, len) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    }
                }
                None => {
                    order.push(id.clone());
                    models.insert(id, (m, len));
                }
            }
        }
    }
    let data: Vec<String> = order
        .iter()
        .map(|id| {
            let (mut m, len) = models.remove(id).expect("inserted");
            if let Some(l) = len {
                m.set_value("max_model_len", &l);
            }
            m.to_json()
        })
        .collect();
    let body = format!("{{\"object\":\"list\",\"data\":[{}]}}", data.join(","));
    (body.into_bytes(), order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_merged_with_the_smallest_max_model_len() {
        let d = Bytes::from_static(
            br#"{"object":"list","data":[{"id":"m","object":"model","root":"r","x":1.50}]}"#,
        );
        let p = Bytes::from_static(br#"{"object":"list","data":[{"id":"m","max_model_len":4096},{"id":"lora","max_model_len":2048}]}"#);
        let p2 = Bytes::from_static(br#"{"data":[{"id":"m","max_model_len":2048}]}"#);
        let (body, ids) = merge_models(&[d, p, p2, Bytes::from_static(b"nope")]);
        assert_eq!(ids, ["m", "lora"]);
        assert_eq!(
            String::from_utf8(body).unwrap(),
            r#"{"object":"list","data":[{"id":"m","object":"model","root":"r","x":1.50,"max_model_len":2048},{"id":"lora","max_model_len":2048}]}"#
        );
    }
}
