//! Key remapping: a checkpoint written under one naming layout seen under another. The tables are
//! the caller's (petite-pi05 supplies lerobot's and the Hub's); this crate only applies them.

use std::collections::HashMap;

use crate::{Error, Result, TensorInfo, TensorView, WeightSource};

/// A small remapping table, applied to every stored name to get the name callers use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyMap {
    /// `(stored_prefix, exposed_prefix)`: a stored name starting with `stored_prefix` is exposed
    /// with that prefix replaced (e.g. `("", "model.")` adds a missing prefix). The first
    /// matching rule wins; names no rule matches are exposed unchanged.
    pub prefixes: Vec<(String, String)>,
    /// `(exposed, stands_in)`: expose `exposed` as a view of the tensor exposed as `stands_in`
    /// (one tensor standing in for another, e.g. tied embeddings). Applied after `prefixes`.
    pub aliases: Vec<(String, String)>,
}

impl KeyMap {
    /// The exposed name of a stored name.
    pub fn expose(&self, stored: &str) -> String {
        for (from, to) in &self.prefixes {
            if let Some(rest) = stored.strip_prefix(from.as_str()) {
                return format!("{to}{rest}");
            }
        }
        stored.to_string()
    }
}

/// A [`WeightSource`] seen through a [`KeyMap`]: names, lookups and releases use exposed names.
#[derive(Debug)]
pub struct Remapped<S> {
    inner: S,
    to_stored: HashMap<String, String>,
    names: Vec<String>,
}

impl<S: WeightSource> Remapped<S> {
    /// Applies `map` to `inner`'s names. Two stored names mapping to one exposed name, or an alias
    /// whose target does not exist, is an error.
    pub fn new(inner: S, map: &KeyMap) -> Result<Self> {
        let mut to_stored = HashMap::new();
        for stored in inner.names() {
            let exposed = map.expose(&stored);
            if let Some(prev) = to_stored.insert(exposed.clone(), stored.clone()) {
                return Err(Error::Selection(format!(
                    "key map sends both `{prev}` and `{stored}` to `{exposed}`"
                )));
            }
        }
        for (exposed, stands_in) in &map.aliases {
            let stored = to_stored.get(stands_in).cloned().ok_or_else(|| {
                Error::Selection(format!(
                    "key map alias `{exposed}` → `{stands_in}`: no tensor `{stands_in}`"
                ))
            })?;
            if to_stored.contains_key(exposed) {
                return Err(Error::Selection(format!(
                    "key map alias `{exposed}` → `{stands_in}`: `{exposed}` already exists"
                )));
            }
            to_stored.insert(exposed.clone(), stored);
        }
        let mut names: Vec<String> = to_stored.keys().cloned().collect();
        names.sort();
        Ok(Remapped {
            inner,
            to_stored,
            names,
        })
    }

    /// The underlying source.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The stored name behind an exposed name.
    pub fn stored_name(&self, exposed: &str) -> Result<&str> {
        self.to_stored
            .get(exposed)
            .map(String::as_str)
            .ok_or_else(|| Error::MissingTensor {
                file: "(remapped checkpoint)".into(),
                name: exposed.to_string(),
            })
    }
}

impl<S: WeightSource> WeightSource for Remapped<S> {
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }
    fn info(&self, name: &str) -> Result<TensorInfo> {
        self.inner.info(self.stored_name(name)?)
    }
    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let (exposed, _) =
            self.to_stored
                .get_key_value(name)
                .ok_or_else(|| Error::MissingTensor {
                    file: "(remapped checkpoint)".into(),
                    name: name.to_string(),
                })?;
        let mut v = self.inner.tensor(self.stored_name(name)?)?;
        v.name = exposed;
        Ok(v)
    }
    fn release(&self, names: &[&str]) -> Result<()> {
        let stored: Vec<&str> = names
            .iter()
            .map(|n| self.stored_name(n))
            .collect::<Result<_>>()?;
        self.inner.release(&stored)
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.inner
            .release_range(self.stored_name(name)?, start, end)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.inner
            .prefetch_range(self.stored_name(name)?, start, end)
    }
    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.inner.unmap_range(self.stored_name(name)?, start, end)
    }
    fn files(&self) -> Vec<std::path::PathBuf> {
        self.inner.files()
    }
    fn check_unchanged(&self) -> Result<()> {
        self.inner.check_unchanged()
    }
}
