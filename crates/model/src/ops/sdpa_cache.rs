//! The cache of cuDNN attention graphs: a handle per CUDA context and a built graph per context,
//! description ([`SdpaDesc`]) and direction, with the graphs cuDNN refused remembered as
//! refused. Pure logic, in every build, so the CPU tests cover it; `cuda/cudnn.rs` keeps one for
//! the process.

use std::collections::HashMap;

use candle_core::Result;

use super::sdpa::SdpaDesc;

/// Forward or backward graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    Forward,
    Backward,
}

/// Why cuDNN does not run a call: the reason its graph could not be built, and whether this is
/// the first call to hear it (the one that reports it; later calls fall back quietly).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: String,
    pub first: bool,
}

/// cuDNN handles per CUDA context and built graphs per context, description and direction:
/// each is made once, and a graph cuDNN cannot build is remembered as refused (`H` and `G` are
/// the shim's opaque pointers and the graph's workspace size; the tests use plain values).
#[derive(Debug)]
pub struct GraphCache<H, G> {
    handles: HashMap<usize, H>,
    graphs: HashMap<(usize, SdpaDesc, Direction), std::result::Result<G, String>>,
}

impl<H, G> Default for GraphCache<H, G> {
    fn default() -> Self {
        Self {
            handles: HashMap::new(),
            graphs: HashMap::new(),
        }
    }
}

impl<H: Copy, G: Copy> GraphCache<H, G> {
    /// The handle of context `ctx`, made by `create` on first use.
    pub fn handle(&mut self, ctx: usize, create: impl FnOnce() -> Result<H>) -> Result<H> {
        if let Some(h) = self.handles.get(&ctx) {
            return Ok(*h);
        }
        let h = create()?;
        self.handles.insert(ctx, h);
        Ok(h)
    }

    /// The graph of `desc` in direction `dir` on context `ctx`, built by `build` on first use;
    /// a build that fails is refused now and on every later call without building again.
    pub fn graph(
        &mut self,
        ctx: usize,
        desc: &SdpaDesc,
        dir: Direction,
        build: impl FnOnce() -> Result<G>,
    ) -> std::result::Result<G, Refusal> {
        let key = (ctx, *desc, dir);
        if let Some(g) = self.graphs.get(&key) {
            return g.clone().map_err(|reason| Refusal {
                reason,
                first: false,
            });
        }
        let g = build().map_err(|e| e.to_string());
        self.graphs.insert(key, g.clone());
        g.map_err(|reason| Refusal {
            reason,
            first: true,
        })
    }

    /// Graphs built so far.
    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    /// Whether no graph was built.
    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::bail;

    use super::*;
    use crate::ops::attention::Dims;
    use crate::ops::sdpa::tests::dims;

    /// A graph is built once per context, description and direction; everything that changes
    /// the graph changes the key.
    #[test]
    fn graphs_are_built_once_and_refusals_remembered() {
        let base = dims(2, 64, 64, 8, 2, 64, true);
        let desc = |dm: Dims, scale: f64, det: bool| SdpaDesc::new(dm, scale, det).unwrap();
        let p = desc(base, 0.125, true);
        let mut cache = GraphCache::<u32, u32>::default();
        let mut builds = 0u32;
        let mut get = |cache: &mut GraphCache<u32, u32>, ctx, d: &SdpaDesc, dir| {
            cache
                .graph(ctx, d, dir, || {
                    builds += 1;
                    Ok(builds)
                })
                .unwrap()
        };
        let first = get(&mut cache, 1, &p, Direction::Forward);
        assert_eq!(get(&mut cache, 1, &p, Direction::Forward), first);
        assert_eq!(
            get(&mut cache, 1, &desc(base, 0.125, true), Direction::Forward),
            first
        );
        assert_eq!(cache.len(), 1);
        let variants = [
            desc(dims(2, 64, 64, 8, 2, 64, false), 0.125, true),
            desc(dims(2, 128, 128, 8, 2, 64, true), 0.125, true),
            desc(dims(2, 64, 64, 8, 4, 64, true), 0.125, true),
            desc(dims(2, 64, 64, 8, 2, 128, true), 0.125, true),
            desc(dims(1, 64, 64, 8, 2, 64, true), 0.125, true),
            desc(dims(2, 64, 128, 8, 2, 64, false), 0.125, true),
            desc(base, 0.0625, true),
            desc(base, 0.125, false),
        ];
        for v in &variants {
            assert_ne!(get(&mut cache, 1, v, Direction::Forward), first, "{v:?}");
        }
        assert_ne!(get(&mut cache, 1, &p, Direction::Backward), first);
        assert_ne!(get(&mut cache, 2, &p, Direction::Forward), first);
        assert_eq!(cache.len(), variants.len() + 3);

        // A failed build is refused, reported once, and never tried again.
        let failed = cache.graph(3, &p, Direction::Forward, || bail!("no engine"));
        let refusal = failed.unwrap_err();
        assert!(
            refusal.first && refusal.reason.contains("no engine"),
            "{refusal:?}"
        );
        let again = cache.graph(3, &p, Direction::Forward, || panic!("built twice"));
        let again = again.unwrap_err();
        assert!(!again.first);
        assert_eq!(again.reason, refusal.reason);
        let other = cache.graph(3, &p, Direction::Backward, || Ok(99));
        assert_eq!(other.unwrap(), 99);

        let mut made = 0;
        for _ in 0..3 {
            cache
                .handle(7, || {
                    made += 1;
                    Ok(5)
                })
                .unwrap();
        }
        assert_eq!(made, 1);
    }
}
