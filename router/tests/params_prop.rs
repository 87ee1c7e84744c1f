//! Property tests of `kv_transfer_params` handling: malformed input is answered
//! with an error naming the field (4xx at the router's edge), never a panic.
mod common;

use common::*;
use kvloop_router::params::KvParams;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{Map, Value, json};

const FIELDS: [&str; 11] = [
    "do_remote_decode",
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
];

fn valid() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_block_ids": [[1, 2, 3]],
           "remote_engine_id": "d0", "remote_request_id": "r", "remote_host": "10.0.0.1",
           "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40,
           "remote_blocks_expiry_time": 12.5, "transfer_mode": "pull"})
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Any JSON at all: parse returns, and an error names one of the known fields.
    #[test]
    fn arbitrary_json_never_panics(v in arb_json()) {
        if let Err(e) = KvParams::parse(&v) {
            prop_assert!(e.field == "." || FIELDS.contains(&e.field), "{e}");
        }
    }

    /// One field of a valid object replaced by arbitrary JSON (or removed):
    /// either still valid, or the error names exactly that field.
    #[test]
    fn one_bad_field_is_named(idx in 0..FIELDS.len(), replacement in prop::option::of(arb_json())) {
        let field = FIELDS[idx];
        let mut v = valid();
        match replacement {
            Some(r) => { v[field] = r; }
            None => { v.as_object_mut().unwrap().remove(field); }
        }
        match KvParams::parse(&v) {
            Ok(p) => {
                // A valid object survives compaction and expansion with its block ids.
                let back = p.compact().expand(&p.remote_engine_id, p.remote_num_tokens.unwrap_or(0), "[::1]");
                prop_assert_eq!(&back["remote_block_ids"], &v["remote_block_ids"]);
            }
            Err(e) => prop_assert_eq!(e.field, field, "{}", e),
        }
    }
}

/// Through a real router: malformed client-supplied params get a 400 naming the
/// field, and the router keeps serving.
#[test]
fn router_answers_4xx_naming_the_field() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = Cluster::start(Opts::default()).await;
        let url = format!("{}/v1/completions", c.router.url());
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 200,
            ..ProptestConfig::default()
        });
        let strat = (0..FIELDS.len(), arb_json());
        for _ in 0..200 {
            let (idx, bad) = strat.new_tree(&mut runner).unwrap().current();
            let field = FIELDS[idx];
            let mut p = valid();
            p[field] = bad;
            let (st, body) = post(
                &c.http,
                &url,
                None,
                &json!({"prompt": "x", "kv_transfer_params": p}),
                false,
            )
            .await;
            assert_eq!(st, 400, "{body}");
            assert!(body.contains("kv_transfer_params"), "{body}");
            if KvParams::parse(&p).is_err() {
                assert!(
                    body.contains(&format!("kv_transfer_params.{field}")),
                    "{field}: {body}"
                );
            }
        }
        let (st, _) = post(&c.http, &url, None, &json!({"prompt": "alive"}), false).await;
        assert_eq!(st, 200);
    });
}
