//! `Policy.predict_action_chunk_model`'s input: a batch as lerobot's PI05 preprocessor emits it,
//! as petite's [`ModelInputs`].

use numpy::{PyArrayDescrMethods, PyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use petite::policy::{Ints, MASK_KEY, ModelInputs, TOKENS_KEY};

use crate::{IMAGES, Want, asarray, bad, to_array, values};

/// Integer values of `key` (numpy arrays, CPU torch tensors, lists; int, uint or bool dtypes) as
/// int64.
fn to_ints(key: &str, v: &Bound<'_, PyAny>) -> PyResult<Ints> {
    let py = v.py();
    let any = asarray(py)?
        .call1((v,))
        .map_err(|e| bad(key, format!("not an array numpy can read ({e})")))?;
    let arr = any
        .cast::<PyUntypedArray>()
        .map_err(|_| bad(key, "not an array numpy can read"))?;
    let dtype = arr.dtype();
    if !matches!(dtype.kind(), b'i' | b'u' | b'b') {
        return Err(bad(
            key,
            format!(
                "expected integers (int64 ids, a bool mask), found a {} array",
                dtype.str()?
            ),
        ));
    }
    let kw = PyDict::new(py);
    kw.set_item("dtype", "int64")?;
    let i = asarray(py)?.call((arr,), Some(&kw))?;
    let (shape, data) = values(i.cast::<PyArrayDyn<i64>>()?)?;
    Ok(Ints { shape, data })
}

/// A preprocessed lerobot batch (a dict or any mapping) as [`ModelInputs`]: the camera keys
/// (`observation.images.*`), `observation.language.tokens` and
/// `observation.language.attention_mask`; other keys (the normalized state, the task, …) are
/// not read by PI05's model and are skipped.
pub(crate) fn to_model_inputs(batch: &Bound<'_, PyAny>) -> PyResult<ModelInputs> {
    let items = if let Ok(d) = batch.cast::<PyDict>() {
        d.items().into_any()
    } else {
        batch.call_method0("items").map_err(|_| {
            PyTypeError::new_err(format!(
                "the batch must be a dict of lerobot's keys, not {}",
                batch
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?
    };
    let mut out = ModelInputs::default();
    let (mut tokens, mut mask) = (None, None);
    for item in items.try_iter()? {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
        let Ok(k) = k.cast::<PyString>() else {
            continue;
        };
        let key = k.to_cow()?;
        let key = key.as_ref();
        if key == TOKENS_KEY {
            tokens = Some(to_ints(key, &v)?);
        } else if key == MASK_KEY {
            mask = Some(to_ints(key, &v)?);
        } else if key.starts_with(IMAGES) {
            out.images
                .insert(key.to_string(), to_array(key, &v, Want::Image)?);
        }
    }
    let missing = |key: &str| {
        bad(
            key,
            "missing: lerobot's PI05 preprocessor (its tokenizer step) writes it",
        )
    };
    out.tokens = tokens.ok_or_else(|| missing(TOKENS_KEY))?;
    out.attention_mask = mask.ok_or_else(|| missing(MASK_KEY))?;
    Ok(out)
}
