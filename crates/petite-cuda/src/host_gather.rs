//! Embedding tables gathered on the host. A large table whose indices are computed from the
//! program's inputs alone (and constants) need not be on the device: the caller's mapped weights
//! keep it, and each run uploads only the rows its indices name, each distinct row once, into a
//! small compact table that the program's embeddings read through renumbered indices.
//!
//! Why: pi0.5's token embedding is 1004.5 MiB in bf16 (16 row shards in an export) of which a
//! chunk reads about 200 rows. On the device it is a fifth of a quantized policy's memory; on an
//! integrated board (Jetson: CPU and GPU share one pool) gathered from the mapping, only the
//! pages of the rows read are resident, and they are page cache the kernel may take back.
//!
//! The result is bit-identical: rows are copied (converted from the stored dtype exactly as an
//! upload converts them), and each embedding still gathers on the device, from indices that are
//! in range by construction. An index outside its table is refused on the host before any work is
//! queued, naming its position.

use std::collections::{BTreeMap, HashMap};

use petite_graph::{Dtype, Node, NodeId, Op, Program, ValueType, WeightInfo};
use petite_reference::{Data, Executor, NoWeights, Tensor};
use petite_weights::{WeightSource, convert_into};

use crate::device::{DevTensor, Device};
use crate::{Error, Result};

pub use crate::settings::MIN_TABLE_BYTES;

/// The name of the compact table's input in a rewritten program.
pub const ROWS_INPUT: &str = "host_gather.rows";

/// One embedding whose table stays on the host.
#[derive(Debug, Clone)]
struct Hosted {
    /// The table it read.
    weight: WeightInfo,
    /// Its table's checkpoint name among the hosted ones (the key of a gathered row).
    table: u64,
    /// The output of [`HostGathers::indices`] that is its original indices.
    output: String,
    /// The new input carrying its renumbered indices (i32, the original indices' shape).
    index_input: String,
    /// The indices' shape.
    shape: Vec<usize>,
    /// Where its renumbered indices start in the index buffer (elements).
    at: usize,
}

/// Hashes a gathered row's key (table and row packed in a `u64`) by one multiply: std's
/// SipHash over a name and a row was most of a gather's host time (pi0.5: 3,200 lookups).
#[derive(Default)]
struct RowHasher(u64);

impl std::hash::Hasher for RowHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(29);
    }
}

/// A program whose large embedding tables are gathered on the host, and how to gather them.
#[derive(Debug, Clone)]
pub struct HostGathers {
    program: Program,
    hosted: Vec<Hosted>,
    /// Computes every hosted embedding's original indices from the program's inputs (a piece
    /// of the original program; one output an embedding, [`Hosted::output`]).
    indices: Program,
    /// The compact table's dtype and row width (every hosted table shares them).
    dtype: Dtype,
    width: usize,
    /// Rows the compact table holds: every hosted index distinct, at worst.
    cap: usize,
}

/// The device buffers a [`HostGathers`] program reads: the compact table and the renumbered
/// indices (each embedding's a view of one buffer).
#[derive(Debug, Clone)]
pub struct GatherBuffers {
    rows: DevTensor,
    index: DevTensor,
}

/// One run's gather on the host, ready to upload.
#[derive(Debug, Default)]
pub struct Gathered {
    rows: Vec<u8>,
    index: Vec<i32>,
    distinct: usize,
    /// A gathered row's key → its place in `rows`: kept between runs, so that a run allocates
    /// nothing once the first has sized it.
    slots: HashMap<u64, i32, std::hash::BuildHasherDefault<RowHasher>>,
}

impl Gathered {
    /// Distinct rows gathered (the rows uploaded).
    pub fn distinct(&self) -> usize {
        self.distinct
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::Plan(msg.into())
}

impl HostGathers {
    /// Rewrites `program` so that each embedding of a weight table of at least `min_bytes` —
    /// read by nothing else, its indices computed from inputs for which `hostable` says the
    /// caller has the host values — reads a compact table and renumbered indices, two new
    /// inputs ([`ROWS_INPUT`], and `host_gather.index.K` per embedding). Every such table must
    /// share one dtype and row width; an embedding that differs from the first stays as it is.
    /// `None` when there is nothing to gather.
    pub fn plan(
        program: &Program,
        min_bytes: usize,
        hostable: &dyn Fn(&str) -> bool,
    ) -> Result<Option<HostGathers>> {
        program.validate()?;
        let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
        let live = program.ancestors(&roots);
        let consumers = program.consumers();
        let weights: HashMap<NodeId, WeightInfo> =
            program.weights().into_iter().map(|w| (w.node, w)).collect();
        let mut picked: Vec<(NodeId, WeightInfo, NodeId)> = Vec::new();
        let mut kind: Option<(Dtype, usize)> = None;
        for id in program.ids() {
            let node = program.node(id);
            if !live[id.index()] || !matches!(node.op, Op::Embedding) {
                continue;
            }
            let (table, idx) = (node.inputs[0], node.inputs[1]);
            let Some(w) = weights.get(&table) else {
                continue;
            };
            if w.bytes < min_bytes || consumers[table.index()].len() != 1 || w.shape.len() != 2 {
                continue;
            }
            let from = program.ancestors(&[idx]);
            let input_only =
                program
                    .ids()
                    .filter(|a| from[a.index()])
                    .all(|a| match &program.node(a).op {
                        Op::Input { name } => hostable(name),
                        Op::Weight { .. } => false,
                        _ => true,
                    });
            if !input_only {
                continue;
            }
            let k = (w.dtype, w.shape[1]);
            if *kind.get_or_insert(k) != k {
                continue;
            }
            picked.push((id, w.clone(), idx));
        }
        let Some((dtype, width)) = kind.filter(|_| !picked.is_empty()) else {
            return Ok(None);
        };
        let names: std::collections::HashSet<&str> = program
            .inputs
            .iter()
            .filter_map(|&i| program.input_name(i))
            .collect();
        let mut rewritten = program.clone();
        let add_input = |p: &mut Program, name: String, dtype: Dtype, shape: Vec<usize>| {
            if names.contains(name.as_str()) {
                return Err(err(format!(
                    "the program already has an input {name:?} (a host gather's)"
                )));
            }
            let id = NodeId(p.nodes.len() as u32);
            p.nodes.push(Node {
                op: Op::Input { name },
                inputs: Vec::new(),
                ty: ValueType::Tensor(petite_graph::TensorType::new(dtype, &shape)),
                label: Some("host_gather".into()),
                recompute: false,
            });
            p.inputs.push(id);
            Ok(id)
        };
        let mut cap = 0usize;
        let mut hosted = Vec::with_capacity(picked.len());
        let mut index_nodes = Vec::with_capacity(picked.len());
        let idxs: Vec<NodeId> = picked.iter().map(|p| p.2).collect();
        let from = program.ancestors(&idxs);
        let nodes: Vec<NodeId> = program.ids().filter(|a| from[a.index()]).collect();
        let sub = program.subprogram(&nodes)?;
        let mut indices = sub.program;
        indices.outputs.clear();
        let mut tables: Vec<&str> = Vec::new();
        for (k, (id, weight, idx)) in picked.iter().enumerate() {
            let shape = program
                .node(*idx)
                .tensor()
                .ok_or_else(|| err("tuple indices"))?
                .shape
                .clone();
            let numel: usize = shape.iter().product();
            let value = sub
                .original
                .iter()
                .position(|v| v == idx)
                .ok_or_else(|| err("the indices are not in their own piece"))?;
            let output = format!("indices.{k}");
            indices.outputs.push(petite_graph::GraphOutput {
                name: output.clone(),
                value: NodeId(value as u32),
            });
            let table = match tables.iter().position(|t| *t == weight.name) {
                Some(t) => t,
                None => {
                    tables.push(&weight.name);
                    tables.len() - 1
                }
            } as u64;
            let index_input = format!("host_gather.index.{k}");
            let node = add_input(
                &mut rewritten,
                index_input.clone(),
                Dtype::I32,
                shape.clone(),
            )?;
            index_nodes.push((*id, node));
            hosted.push(Hosted {
                weight: weight.clone(),
                table,
                output,
                index_input,
                shape,
                at: cap,
            });
            cap += numel;
        }
        indices.validate()?;
        let rows = add_input(
            &mut rewritten,
            ROWS_INPUT.to_string(),
            dtype,
            vec![cap.max(1), width],
        )?;
        for (id, index) in index_nodes {
            rewritten.nodes[id.index()].inputs = vec![rows, index];
        }
        rewritten.validate()?;
        Ok(Some(HostGathers {
            program: rewritten,
            hosted,
            indices,
            dtype,
            width,
            cap,
        }))
    }

    /// The rewritten program (the tables' weights no longer read).
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The original program's inputs the gathers read (their values are needed on the host).
    pub fn inputs_read(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .indices
            .inputs
            .iter()
            .filter_map(|&i| self.indices.input_name(i).map(str::to_string))
            .collect();
        v.sort();
        v
    }

    /// Embeddings gathered on the host, and the bytes of their tables (left off the device).
    pub fn tables(&self) -> (usize, u64) {
        (
            self.hosted.len(),
            self.hosted.iter().map(|h| h.weight.bytes as u64).sum(),
        )
    }

    /// Computes each embedding's indices from `inputs` (the original program's, by name; at
    /// least [`HostGathers::inputs_read`]) and gathers the rows they name from `weights` into
    /// `out`, each distinct row once. An index outside its table is an error naming it.
    pub fn gather(
        &self,
        inputs: &BTreeMap<String, Tensor>,
        weights: &dyn WeightSource,
        out: &mut Gathered,
    ) -> Result<()> {
        out.rows.clear();
        out.index.clear();
        out.distinct = 0;
        out.slots.clear();
        let row_bytes = self.width * self.dtype.size();
        let mut ins = BTreeMap::new();
        for &i in &self.indices.inputs {
            let name = self.indices.input_name(i).unwrap_or_default();
            let t = inputs.get(name).ok_or_else(|| Error::Input {
                name: name.to_string(),
                message: "needed on the host to gather an embedding's rows".into(),
            })?;
            ins.insert(name.to_string(), t.clone());
        }
        let mut outs = Executor::new(&self.indices, &NoWeights)?.run(ins)?;
        for h in &self.hosted {
            let idx = outs
                .remove(&h.output)
                .ok_or_else(|| err(format!("no {} computed", h.output)))?;
            let values: std::borrow::Cow<'_, [i64]> = match idx.data() {
                Data::I64(v) => v.as_slice().into(),
                Data::I32(v) => v.iter().map(|&x| x as i64).collect::<Vec<_>>().into(),
                _ => return Err(err("embedding indices are not integers")),
            };
            let view = weights.tensor(&h.weight.name)?;
            let stored = view.dtype;
            if stored != self.dtype && !(stored.is_float() && self.dtype.is_float()) {
                return Err(err(format!(
                    "weight {:?}: stored as {} but declared {}",
                    h.weight.name,
                    stored.name(),
                    self.dtype.name()
                )));
            }
            let rows = h.weight.shape[0];
            let first = h.weight.rows.map_or(0, |[a, _]| a);
            let stored_row = self.width * stored.size();
            for (pos, &v) in values.iter().enumerate() {
                if v < 0 || v as u64 >= rows as u64 {
                    return Err(err(format!(
                        "an embedding index at position {pos} is {v}, outside its table {} of {rows} rows",
                        h.weight.display_name()
                    )));
                }
                let row = first + v as usize;
                let key = (h.table << 40) | row as u64;
                let slot = match out.slots.get(&key) {
                    Some(&s) => s,
                    None => {
                        let src = view
                            .bytes
                            .get(row * stored_row..(row + 1) * stored_row)
                            .ok_or_else(|| {
                                err(format!(
                                    "weight {:?}: no bytes for row {row}",
                                    h.weight.name
                                ))
                            })?;
                        let at = out.rows.len();
                        out.rows.resize(at + row_bytes, 0);
                        convert_into(stored, self.dtype, src, &mut out.rows[at..]);
                        let s = out.distinct as i32;
                        out.distinct += 1;
                        out.slots.insert(key, s);
                        s
                    }
                };
                out.index.push(slot);
            }
            debug_assert_eq!(out.index.len(), h.at + values.len());
        }
        Ok(())
    }

    /// The device buffers this program's gathers are uploaded into (allocated once; a CUDA
    /// graph reads them at fixed addresses).
    pub fn alloc(&self, dev: &Device) -> Result<GatherBuffers> {
        Ok(GatherBuffers {
            rows: dev.zeros(self.dtype, &[self.cap.max(1), self.width])?,
            index: dev.zeros(Dtype::I32, &[self.cap.max(1)])?,
        })
    }

    /// Queues `g`'s rows and indices into `bufs` on the device's stream (ordered after the work
    /// already queued, which may still read the last ones). `g` may be reused at once.
    pub fn upload(&self, dev: &Device, bufs: &GatherBuffers, g: &Gathered) -> Result<()> {
        if g.index.len() != self.cap || g.distinct > self.cap {
            return Err(err(format!(
                "a gather of {} indices ({} rows) for {} places",
                g.index.len(),
                g.distinct,
                self.cap
            )));
        }
        dev.write(&bufs.rows, &g.rows)?;
        // Little-endian i32s, as the device reads them (every CUDA host is little-endian).
        dev.write(&bufs.index, bytemuck::cast_slice(&g.index))
    }

    /// The rewritten program's extra inputs, by name, as views of `bufs`.
    pub fn inputs(&self, bufs: &GatherBuffers) -> Vec<(String, DevTensor)> {
        let mut v = vec![(ROWS_INPUT.to_string(), bufs.rows.clone())];
        for h in &self.hosted {
            v.push((h.index_input.clone(), bufs.index.view(h.at * 4, &h.shape)));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use petite_graph::Builder;
    use petite_reference::MemoryWeights;

    /// A table of `rows × 8` f32 values stored, read as bf16 (the gather converts as an upload
    /// does), and tokens through `embed`, doubled.
    fn program(
        rows: usize,
        tokens: usize,
        embed: impl Fn(
            &mut Builder,
            petite_graph::ValueId,
        ) -> petite_graph::Result<petite_graph::ValueId>,
    ) -> (Program, MemoryWeights) {
        let mut b = Builder::new();
        let t = b.input("tokens", Dtype::I64, &[tokens]).unwrap();
        let e = embed(&mut b, t).unwrap();
        let y = b.mul_scalar(e, 2.0).unwrap();
        b.output("y", y).unwrap();
        let mut w = MemoryWeights::new();
        let values: Vec<f32> = (0..rows * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        w.insert_f32("emb", &[rows, 8], &values).unwrap();
        (b.finish().unwrap(), w)
    }

    fn tokens(v: &[i64]) -> BTreeMap<String, Tensor> {
        BTreeMap::from([(
            "tokens".to_string(),
            Tensor::i64(&[v.len()], v.to_vec()).unwrap(),
        )])
    }

    /// The rewritten program run on the host with the gather's compact table and indices.
    fn run_gathered(
        hg: &HostGathers,
        w: &MemoryWeights,
        ins: &BTreeMap<String, Tensor>,
    ) -> Result<(Vec<u8>, usize)> {
        let mut g = Gathered::default();
        hg.gather(ins, w, &mut g)?;
        let mut feed = ins.clone();
        let mut rows = g.rows.clone();
        rows.resize(hg.cap * hg.width * hg.dtype.size(), 0);
        feed.insert(
            ROWS_INPUT.into(),
            Tensor::from_bytes(hg.dtype, &[hg.cap, hg.width], &rows)?,
        );
        for h in &hg.hosted {
            let n = h.shape.clone();
            let k: usize = n.iter().product();
            let bytes: Vec<u8> = g.index[h.at..h.at + k]
                .iter()
                .flat_map(|i| i.to_le_bytes())
                .collect();
            feed.insert(
                h.index_input.clone(),
                Tensor::from_bytes(Dtype::I32, &n, &bytes)?,
            );
        }
        let out = Executor::new(hg.program(), w)?.run(feed)?;
        Ok((out["y"].to_bytes(), g.distinct()))
    }

    #[test]
    fn a_sharded_tables_rows_gathered_on_the_host_give_the_same_bits() {
        // 40 rows of 8 bf16 in shards of 10 rows: four row-range weights, each gathered once a
        // distinct row (every shard also reads its first row, for the tokens outside it).
        let (p, w) = program(40, 6, |b, t| {
            b.embedding_sharded("emb", Dtype::Bf16, &[40, 8], t, 160)
        });
        let hg = HostGathers::plan(&p, 0, &|_| true)
            .unwrap()
            .expect("four shards hosted");
        assert_eq!(hg.tables(), (4, 4 * 10 * 8 * 2));
        assert_eq!(hg.inputs_read(), vec!["tokens".to_string()]);
        assert!(
            hg.program().weights().iter().all(|wi| !hg
                .program()
                .ancestors(&[hg.program().outputs[0].value])[wi.node.index()]),
            "no table is read by the rewritten program"
        );
        for toks in [
            [3, 17, 17, 39, 0, 25],
            [0, 0, 0, 0, 0, 0],
            [39, 38, 30, 29, 20, 10],
        ] {
            let ins = tokens(&toks);
            let want = Executor::new(&p, &w).unwrap().run(ins.clone()).unwrap()["y"].to_bytes();
            let (got, distinct) = run_gathered(&hg, &w, &ins).unwrap();
            assert_eq!(got, want, "tokens {toks:?}");
            assert!(
                distinct <= 6 + 4,
                "{distinct} rows for 6 tokens and 4 shards"
            );
        }
        let (_, distinct) = run_gathered(&hg, &w, &tokens(&[3, 17, 17, 39, 0, 25])).unwrap();
        assert_eq!(distinct, 8, "rows 3, 0 | 17, 10 | 25, 20 | 39, 30");
    }

    #[test]
    fn an_index_outside_its_table_is_refused_on_the_host_naming_its_position() {
        let (p, w) = program(40, 3, |b, t| {
            let table = b.weight("emb", Dtype::Bf16, &[40, 8])?;
            b.embedding(table, t)
        });
        let hg = HostGathers::plan(&p, 0, &|_| true).unwrap().unwrap();
        let (got, _) = run_gathered(&hg, &w, &tokens(&[1, 39, 2])).unwrap();
        let want = Executor::new(&p, &w)
            .unwrap()
            .run(tokens(&[1, 39, 2]))
            .unwrap()["y"]
            .to_bytes();
        assert_eq!(got, want);
        for bad in [40, -1] {
            let e = run_gathered(&hg, &w, &tokens(&[1, bad, 2]))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&format!("position 1 is {bad}")) && e.contains("emb"),
                "{e}"
            );
        }
    }

    #[test]
    fn small_tables_and_indices_the_host_lacks_stay_on_the_device() {
        let (p, _) = program(40, 3, |b, t| {
            let table = b.weight("emb", Dtype::Bf16, &[40, 8])?;
            b.embedding(table, t)
        });
        assert!(HostGathers::plan(&p, 641, &|_| true).unwrap().is_none());
        assert!(HostGathers::plan(&p, 640, &|_| true).unwrap().is_some());
        assert!(
            HostGathers::plan(&p, 0, &|n| n != "tokens")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn pi05s_token_embedding_is_gathered_on_the_host_whole_in_both_precisions() {
        for (name, p) in &crate::pi05_programs() {
            let hg = HostGathers::plan(p, MIN_TABLE_BYTES, &|_| true).unwrap();
            if !name.ends_with("prefix") {
                assert!(hg.is_none(), "{name}");
                continue;
            }
            let hg = hg.expect("the prefix's token embedding");
            let (n, bytes) = hg.tables();
            let elem = if name.starts_with("Bf16") { 2 } else { 4 };
            // 257,152 rows of 2,048 in 64 MiB shards: 16 in bf16, 32 in f32.
            assert_eq!(bytes, 257_152 * 2048 * elem as u64, "{name}");
            assert_eq!(n, 16 * elem / 2, "{name}");
            assert_eq!(hg.inputs_read(), ["tokens"]);
            let q = hg.program();
            let live = q.ancestors(&q.outputs.iter().map(|o| o.value).collect::<Vec<_>>());
            let names: Vec<_> = q
                .weights()
                .into_iter()
                .filter(|w| live[w.node.index()])
                .map(|w| w.name)
                .collect();
            assert!(
                !names.iter().any(|w| w == petite_pi05::names::EMBED_TOKENS),
                "{name}: the table is still read"
            );
            assert_eq!(
                q.weight_bytes() as u64,
                p.weight_bytes() as u64,
                "the weights are still declared (dead)"
            );
            // The rows: every token distinct and 16 shards' first rows at worst.
            assert_eq!(hg.cap, 200 * n, "{name}");
        }
    }
}
