//! Config parsing and validation: every bad input gets one error naming the field.
use petite_pi05::{Error, Pi05Config};
use serde_json::Value;

const REAL_JSON: &str = r#"{
  "vision":   {"image_size": 224, "patch_size": 14, "hidden": 1152, "layers": 27, "heads": 16, "mlp": 4304, "eps": 1e-6},
  "language": {"width": 2048, "depth": 18, "heads": 8, "kv_heads": 1, "head_dim": 256, "mlp": 16384, "vocab": 257152, "eps": 1e-6, "rope_theta": 10000.0},
  "expert":   {"width": 1024, "depth": 18, "heads": 8, "kv_heads": 1, "head_dim": 256, "mlp": 4096, "eps": 1e-6},
  "cameras": 3, "tokens": 200, "chunk": 50, "action_dim": 32, "steps": 10,
  "time_min_period": 0.004, "time_max_period": 4.0
}"#;

#[test]
fn issue_json_is_the_default() {
    let cfg = Pi05Config::from_json_str(REAL_JSON, "issue").unwrap();
    assert_eq!(cfg, Pi05Config::default());
    assert_eq!(cfg.prefix_len(), 968);
    assert_eq!(cfg.patches(), 256);
}

#[test]
fn json_round_trips_and_serde_agrees() {
    for cfg in [Pi05Config::default(), Pi05Config::small()] {
        cfg.validate().unwrap();
        let text = cfg.to_json_pretty();
        assert_eq!(Pi05Config::from_json_str(&text, "x").unwrap(), cfg);
        let via_serde: Pi05Config = serde_json::from_str(&text).unwrap();
        assert_eq!(via_serde, cfg);
    }
    // Field order is the documented schema's.
    let text = Pi05Config::default().to_json_pretty();
    let keys: Vec<String> = serde_json::from_str::<serde_json::Map<String, Value>>(&text)
        .unwrap()
        .keys()
        .cloned()
        .collect();
    assert_eq!(
        keys,
        [
            "vision",
            "language",
            "expert",
            "cameras",
            "tokens",
            "chunk",
            "action_dim",
            "steps",
            "time_min_period",
            "time_max_period"
        ]
    );
}

/// Applies `edit` to the real JSON and returns the error message.
fn err_of(edit: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(REAL_JSON).unwrap();
    edit(&mut v);
    let e = Pi05Config::from_json_str(&v.to_string(), "cfg.json").unwrap_err();
    assert!(matches!(e, Error::ConfigField { .. }), "{e:?}");
    e.to_string()
}

fn assert_has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "`{msg}` lacks `{p}`");
    }
}

#[test]
fn missing_field_named_with_path() {
    let m = err_of(|v| {
        v["expert"].as_object_mut().unwrap().remove("head_dim");
    });
    assert_has(&m, &["cfg.json", "`expert.head_dim`", "missing"]);
    let m = err_of(|v| {
        v.as_object_mut().unwrap().remove("steps");
    });
    assert_has(&m, &["`steps`", "missing"]);
}

#[test]
fn wrong_type_and_unknown_field() {
    let m = err_of(|v| v["vision"]["heads"] = Value::from("16"));
    assert_has(&m, &["`vision.heads`", "non-negative integer", "\"16\""]);
    let m = err_of(|v| v["language"]["rope_theta"] = Value::Null);
    assert_has(&m, &["`language.rope_theta`", "a number", "null"]);
    let m = err_of(|v| v["language"]["kv_heads"] = Value::from(-1));
    assert_has(&m, &["`language.kv_heads`", "-1"]);
    let m = err_of(|v| v["language"]["kv_head"] = Value::from(1));
    assert_has(&m, &["`language.kv_head`", "no such field"]);
    let m = err_of(|v| v["expert"] = Value::from(3));
    assert_has(&m, &["`expert`", "an object", "3"]);
}

#[test]
fn not_json_is_an_error() {
    let e = Pi05Config::from_json_str("{ nope", "c.json").unwrap_err();
    assert!(e.to_string().contains("c.json: not valid JSON"), "{e}");
}

#[test]
fn inconsistent_configs_name_field_expected_found() {
    let m = err_of(|v| v["expert"]["depth"] = Value::from(17));
    assert_has(&m, &["`expert.depth`", "expected 18", "found 17"]);
    let m = err_of(|v| v["expert"]["heads"] = Value::from(4));
    assert_has(&m, &["`expert.heads`", "expected 8", "found 4"]);
    let m = err_of(|v| v["expert"]["kv_heads"] = Value::from(2));
    assert_has(&m, &["`expert.kv_heads`", "expected 1", "found 2"]);
    let m = err_of(|v| v["expert"]["head_dim"] = Value::from(128));
    assert_has(&m, &["`expert.head_dim`", "expected 256", "found 128"]);
    let m = err_of(|v| v["vision"]["patch_size"] = Value::from(15));
    assert_has(
        &m,
        &[
            "`vision.patch_size`",
            "divisor of vision.image_size (224)",
            "found 15",
        ],
    );
    let m = err_of(|v| v["language"]["kv_heads"] = Value::from(3));
    assert_has(
        &m,
        &[
            "`language.kv_heads`",
            "divisor of language.heads (8)",
            "found 3",
        ],
    );
    let m = err_of(|v| v["vision"]["heads"] = Value::from(7));
    assert_has(
        &m,
        &[
            "`vision.heads`",
            "divisor of vision.hidden (1152)",
            "found 7",
        ],
    );
    let m = err_of(|v| v["chunk"] = Value::from(0));
    assert_has(&m, &["`chunk`", "positive integer", "found 0"]);
    let m = err_of(|v| v["vision"]["eps"] = Value::from(0.0));
    assert_has(&m, &["`vision.eps`", "positive finite", "found 0"]);
    let m = err_of(|v| v["time_min_period"] = Value::from(5.0));
    assert_has(
        &m,
        &[
            "`time_min_period`",
            "less than time_max_period (4)",
            "found 5",
        ],
    );
}

#[test]
fn validate_in_code_names_field() {
    let mut c = Pi05Config::small();
    c.expert.depth += 1;
    let e = c.validate().unwrap_err();
    assert!(
        matches!(e, Error::InvalidConfig { ref field, .. } if field == "expert.depth"),
        "{e}"
    );
}

#[test]
fn file_errors_name_the_file() {
    let e = Pi05Config::from_json_file("/nonexistent/cfg.json").unwrap_err();
    assert!(e.to_string().contains("/nonexistent/cfg.json"), "{e}");
}

#[test]
fn timesteps_are_lerobots_f32_values() {
    let t = Pi05Config::default().timesteps();
    assert_eq!(t.len(), 10);
    assert_eq!(t[0], 1.0);
    assert_eq!(t[1].to_bits(), 0x3f666666);
    assert_eq!(t[9].to_bits(), 0x3dcccccd);
    assert_eq!(Pi05Config::default().dt(), -0.1f32);
}

#[test]
fn serde_errors_are_one_line_with_path_expected_found() {
    let m = err_of(|v| v["expert"]["heads"] = Value::from(1.5));
    assert_eq!(
        m,
        "cfg.json: config field `expert.heads`: expected a non-negative integer, found floating point `1.5`"
    );
    let m = err_of(|v| v["vision"]["eps"] = Value::from("tiny"));
    assert_eq!(
        m,
        "cfg.json: config field `vision.eps`: expected a number, found string \"tiny\""
    );
    let m = err_of(|v| *v = Value::from(7));
    assert_has(&m, &["`(top level)`", "an object", "integer `7`"]);
    let m = err_of(|v| v["vision"]["mlp"] = Value::from("x".repeat(100)));
    assert!(m.contains('…') && m.len() < 140, "{m}");
    let m = err_of(|v| {
        v["expert"].as_object_mut().unwrap().remove("eps");
    });
    assert_has(&m, &["`expert.eps`", "expected a number", "missing"]);
    let m = err_of(|v| v["vision"]["heads"] = Value::from(-16));
    assert_has(&m, &["`vision.heads`", "non-negative integer", "-16"]);
    assert!(!m.contains('\n') && !m.contains("line 1"), "{m}");
}

#[test]
fn duplicate_fields_and_trailing_text_are_refused() {
    let text = REAL_JSON.replacen("\"cameras\": 3,", "\"cameras\": 3, \"cameras\": 4,", 1);
    let m = Pi05Config::from_json_str(&text, "d.json")
        .unwrap_err()
        .to_string();
    assert!(
        m.contains("`cameras`") && m.contains("once") && m.contains("twice"),
        "{m}"
    );
    let e = Pi05Config::from_json_str(&format!("{REAL_JSON} x"), "t.json").unwrap_err();
    assert!(e.to_string().contains("t.json: not valid JSON"), "{e}");
}
