//! The job's channel list (`job_channels`, what `Comm::prepare` sets up before the first step)
//! covers every group and point-to-point direction a rank uses: each rank trains a step,
//! evaluates and saves a checkpoint through a communicator that records what it is asked to
//! use, and every recorded channel must be in the list, which is the same on every rank.

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{DType, Shape, Tensor};
use parallel::comm::local::run_local;
use parallel::comm::{Result, Transfer};
use parallel::{Channel, Comm, Group, ReduceOp};
use pretrain::train::rank::job_channels;
use pretrain::train::{RankCtx, Trainer};

/// A communicator that records the channels it is asked to use, then forwards to `inner`.
struct Recording {
    inner: Arc<dyn Comm>,
    used: Mutex<HashSet<Channel>>,
}

impl Recording {
    fn note(&self, c: Channel) {
        self.used.lock().unwrap().insert(c);
    }
    fn group(&self, g: &Group) {
        self.note(Channel::Group(g.clone()));
    }
}

impl Comm for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, g: &Group, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.group(g);
        self.inner.all_reduce(g, t, op)
    }
    fn all_gather(&self, g: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.group(g);
        self.inner.all_gather(g, t, dim)
    }
    fn reduce_scatter(&self, g: &Group, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.group(g);
        self.inner.reduce_scatter(g, t, dim)
    }
    fn broadcast(&self, g: &Group, t: &Tensor, root: usize) -> Result<Tensor> {
        self.group(g);
        self.inner.broadcast(g, t, root)
    }
    fn all_to_all(&self, g: &Group, t: &Tensor, send: &[usize], recv: &[usize]) -> Result<Tensor> {
        self.note(Channel::AllToAll(g.clone()));
        self.inner.all_to_all(g, t, send, recv)
    }
    fn send(&self, t: &Tensor, dst: usize) -> Result<()> {
        self.note(Channel::P2p {
            src: self.rank(),
            dst,
        });
        self.inner.send(t, dst)
    }
    fn recv(&self, src: usize, shape: &Shape, dtype: DType) -> Result<Tensor> {
        self.note(Channel::P2p {
            src,
            dst: self.rank(),
        });
        self.inner.recv(src, shape, dtype)
    }
    fn barrier(&self, g: &Group) -> Result<()> {
        self.group(g);
        self.inner.barrier(g)
    }
    fn barrier_within(&self, g: &Group, timeout: Duration) -> Result<()> {
        self.group(g);
        self.inner.barrier_within(g, timeout)
    }
    fn send_recv(&self, g: &Group, t: &Tensor, dst: usize, src: usize) -> Result<Transfer> {
        self.note(Channel::Ring(g.clone()));
        self.inner.send_recv(g, t, dst, src)
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

#[test]
fn the_channel_list_covers_what_a_step_uses() {
    let layouts = [
        ("recipes/tiny.yaml", "parallel.dp=2,parallel.tp=2,parallel.sequence_parallel=true,parallel.pp=2,parallel.virtual_stages=2,parallel.zero=1"),
        ("recipes/tiny.yaml", "parallel.dp=2,parallel.cp=2,parallel.zero=3"),
        ("recipes/tiny.yaml", "parallel.dp=4,parallel.pp=2,parallel.zero=2,parallel.zero_shard_size=2"),
        ("recipes/tiny-moe.yaml", "parallel.dp=4,parallel.ep=2,parallel.pp=2,parallel.zero=1"),
        ("recipes/tiny-moe.yaml", "parallel.dp=4,parallel.ep=2"),
        // The tied embedding's first and last stage, not a pipeline group of their own.
        ("recipes/tiny.yaml", "parallel.pp=4,model.tie_word_embeddings=true"),
    ];
    for (path, layout) in layouts {
        let dir = tempfile::tempdir().unwrap();
        let o = vec![
            "train.steps=2,schedule.warmup_steps=1,train.eval_interval=1,train.eval_batches=1,train.global_batch=16,train.micro_batch=2".to_string(),
            format!("run.dir={}", dir.path().display()),
            layout.to_string(),
        ];
        let recipe = pretrain::recipe::load(Path::new(path), &o).unwrap();
        let world = recipe.parallel.world_size();
        let lists = run_local(world, Duration::from_secs(120), |rank, comm| {
            let listed = job_channels(&recipe.parallel, &comm)?;
            let rec = Arc::new(Recording {
                inner: comm,
                used: Mutex::new(HashSet::new()),
            });
            let ctx = RankCtx::new(&recipe.parallel, rank, rec.clone())?;
            let mut trainer = Trainer::new(recipe.clone(), ctx, false)?;
            trainer.train_step()?;
            trainer.evaluate()?;
            trainer.save_checkpoint()?;
            let used = rec.used.lock().unwrap().clone();
            let missing: Vec<_> = used.iter().filter(|c| !listed.contains(c)).collect();
            anyhow::ensure!(
                missing.is_empty(),
                "{layout}: rank {rank} used unlisted channels {missing:?}"
            );
            Ok::<_, anyhow::Error>(listed)
        })
        .unwrap_or_else(|e| panic!("{path} {layout}: {:#}", e.error));
        assert!(
            lists.iter().all(|l| *l == lists[0]),
            "{layout}: ranks list channels differently"
        );
        let unique: HashSet<_> = lists[0].iter().collect();
        assert_eq!(
            unique.len(),
            lists[0].len(),
            "{layout}: a channel is listed twice"
        );
    }
}
