//! A checkpoint: one safetensors file, or several shards tied together by a
//! `model.safetensors.index.json`, seen as one [`WeightSource`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::header::parse_index;
use crate::{Error, MappedSafetensors, Result, Role, TensorInfo, TensorView, WeightSource};

/// A single mapped file or a sharded checkpoint. Each shard is mapped once; a lookup goes to the
/// shard the index names.
#[derive(Debug)]
pub struct Checkpoint {
    origin: PathBuf,
    shards: Vec<MappedSafetensors>,
    by_name: HashMap<String, usize>,
    names: Vec<String>,
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, an index `.json`, or a directory holding
    /// `model.safetensors.index.json` or else `model.safetensors`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join("model.safetensors.index.json");
            if index.exists() {
                return Self::open_index(&index);
            }
            return Self::open_file(&path.join("model.safetensors"));
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Self::open_index(path);
        }
        Self::open_file(path)
    }

    fn open_file(path: &Path) -> Result<Self> {
        let m = MappedSafetensors::open_as(path, Role::Checkpoint)?;
        let names = m.names();
        let by_name = names.iter().map(|n| (n.clone(), 0)).collect();
        Ok(Checkpoint {
            origin: path.to_path_buf(),
            shards: vec![m],
            by_name,
            names,
        })
    }

    /// Opens a sharded checkpoint through its index. Every shard the index names must exist and
    /// hold every tensor the index places in it.
    pub fn open_index(index: &Path) -> Result<Self> {
        let shown = index.display().to_string();
        let bytes = std::fs::read(index).map_err(|e| Error::io(index, "read", e))?;
        let idx = parse_index(&shown, &bytes)?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shard_of: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut by_name = HashMap::with_capacity(idx.weight_map.len());
        for (name, shard) in &idx.weight_map {
            let i = match shard_of.get(shard) {
                Some(&i) => i,
                None => {
                    let p = dir.join(shard);
                    if !p.is_file() {
                        return Err(Error::MissingShard {
                            index: shown,
                            shard: shard.clone(),
                            tensor: name.clone(),
                        });
                    }
                    shards.push(MappedSafetensors::open_as(&p, Role::Checkpoint)?);
                    shard_of.insert(shard.clone(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            if shards[i].info(name).is_err() {
                return Err(Error::InvalidIndex {
                    file: shown,
                    tensor: Some(name.clone()),
                    reason: format!("shard `{shard}` holds no such tensor"),
                });
            }
            by_name.insert(name.clone(), i);
        }
        let mut names: Vec<String> = by_name.keys().cloned().collect();
        names.sort();
        Ok(Checkpoint {
            origin: index.to_path_buf(),
            shards,
            by_name,
            names,
        })
    }

    /// The mapped files.
    pub fn shards(&self) -> &[MappedSafetensors] {
        &self.shards
    }

    fn shard(&self, name: &str) -> Result<&MappedSafetensors> {
        self.by_name
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| Error::MissingTensor {
                file: self.origin.display().to_string(),
                name: name.to_string(),
            })
    }

    /// Bytes of all shards in memory (page cache), per `mincore`.
    pub fn resident_bytes(&self) -> Result<usize> {
        self.shards.iter().map(|s| s.resident_bytes()).sum()
    }
}

impl WeightSource for Checkpoint {
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }
    fn info(&self, name: &str) -> Result<TensorInfo> {
        self.shard(name)?.info(name)
    }
    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        self.shard(name)?.tensor(name)
    }
    fn release(&self, names: &[&str]) -> Result<()> {
        for n in names {
            self.shard(n)?.release(&[n])?;
        }
        Ok(())
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.shard(name)?.release_range(name, start, end)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.shard(name)?.prefetch_range(name, start, end)
    }
    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        self.shard(name)?.unmap_range(name, start, end)
    }
    fn files(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path().to_path_buf()).collect()
    }
    fn check_unchanged(&self) -> Result<()> {
        self.shards.iter().try_for_each(|s| s.check_unchanged())
    }
}
