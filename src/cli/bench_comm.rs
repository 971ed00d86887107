//! `pretrain bench-comm`: host time per communication call, as the trainer issues them, over the
//! job's backend (NCCL between GPUs, `tcp` between CPU processes, threads in one process):
//! an all-reduce from the compute thread (stream-ordered on NCCL: the host only enqueues), the
//! same in place from a communication thread (each waited for, as data-parallel buckets are)
//! and a ring hop (`Comm::send_recv`, waited for). With `--nproc-per-node N` it starts N rank
//! processes as training does; started by torchrun or Slurm it joins their job. Rank 0 prints
//! one JSON line.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use clap::Args;
use parallel::comm::thread::CommThread;
use parallel::{Channel, Comm, Group, ReduceOp};

use super::{LaunchArgs, RecipeArgs};

/// Arguments of `pretrain bench-comm`.
#[derive(Debug, Args)]
pub struct CommArgs {
    /// The recipe (its layout's world size is the job's; its device is used).
    #[command(flatten)]
    pub recipe: RecipeArgs,
    /// Timed calls of each kind (after 20 warm-up calls).
    #[arg(long, default_value_t = 1000)]
    pub calls: usize,
    /// Elements (f32) per call.
    #[arg(long, default_value_t = 1024)]
    pub elements: usize,
    /// Launcher options.
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// Microseconds of host time per call of each kind.
#[derive(Debug, serde::Serialize)]
pub struct CommTiming {
    /// `nccl`, `tcp` or `local`.
    pub backend: &'static str,
    /// Ranks.
    pub world: usize,
    /// f32 elements per call.
    pub elements: usize,
    /// All-reduce from the compute thread (NCCL: enqueued, not waited for).
    pub all_reduce_us: f64,
    /// The same calls and the wait for the last one.
    pub all_reduce_done_us: f64,
    /// All-reduce in place from a communication thread, each waited for.
    pub in_place_comm_thread_us: f64,
    /// A ring hop, posted and waited for.
    pub send_recv_us: f64,
}

/// Runs the benchmark: starts the rank processes, or is one of them.
pub fn bench_comm(a: &CommArgs) -> Result<()> {
    if a.calls == 0 || a.elements == 0 {
        bail!("--calls and --elements must be positive");
    }
    if a.launch.gpus.is_some() || a.launch.elastic.is_some() {
        bail!("bench-comm runs the recipe's layout as it is: --gpus and --elastic do not apply");
    }
    let recipe = a.recipe.load()?;
    if let Some(nproc_per_node) = a.launch.nproc_per_node {
        crate::launch::check_not_nested(&|k| std::env::var(k).ok())?;
        let layout = crate::launch::NodeLayout {
            nproc_per_node,
            nnodes: a.launch.nnodes,
            node_rank: a.launch.node_rank,
            master_addr: a.launch.master_addr.clone(),
            master_port: a.launch.master_port,
        };
        let mut child: Vec<OsString> = vec!["bench-comm".into(), "--recipe".into()];
        child.push(a.recipe.recipe.clone().into());
        for o in &a.recipe.overrides {
            child.extend(["--set".into(), o.into()]);
        }
        child.extend(["--calls".into(), a.calls.to_string().into()]);
        child.extend(["--elements".into(), a.elements.to_string().into()]);
        let grace = Duration::from_secs_f64(recipe.parallel.timeout_s.min(10.0));
        let flight = crate::job::flight::dir(&recipe);
        let world = recipe.parallel.world_size();
        return crate::launch::spawn_node(&layout, &child, world, grace, &flight);
    }
    let Some(info) = parallel::env::from_env(&|k| std::env::var(k).ok())? else {
        bail!(
            "bench-comm measures a job of two or more ranks: give --nproc-per-node N, or start it \
             with torchrun or Slurm"
        );
    };
    let job = crate::launch::join(&info, &recipe)?;
    let backend = if job.device.is_cuda() { "nccl" } else { "tcp" };
    let t = measure(job.comm.clone(), &job.device, backend, a.calls, a.elements)?;
    if info.rank == 0 {
        println!("{}", serde_json::to_string(&t)?);
    }
    Ok(())
}

/// The timings of [`CommTiming`] on `comm`, every rank of the job taking part.
pub fn measure(
    comm: std::sync::Arc<dyn Comm>,
    device: &candle_core::Device,
    backend: &'static str,
    calls: usize,
    elements: usize,
) -> Result<CommTiming> {
    let n = comm.world_size();
    let world = Group::new((0..n).collect());
    comm.prepare(&[Channel::Group(world.clone()), Channel::Ring(world.clone())])?;
    let x = Tensor::ones(elements, DType::F32, device)?;
    let per_call = |t0: Instant| t0.elapsed().as_secs_f64() * 1e6 / calls as f64;
    let mut last = x.clone();
    for _ in 0..20 {
        last = comm.all_reduce(&world, &x, ReduceOp::Sum)?;
    }
    crate::device::synchronize(device)?;
    let t0 = Instant::now();
    for _ in 0..calls {
        last = comm.all_reduce(&world, &x, ReduceOp::Sum)?;
    }
    let all_reduce_us = per_call(t0);
    let total: f32 = last.sum_all()?.to_scalar()?;
    let all_reduce_done_us = per_call(t0);
    if total != (elements * n) as f32 {
        bail!(
            "all-reduce of ones over {n} ranks summed to {total}, not {}",
            elements * n
        );
    }
    // In place on a communication thread, after a hand-off mark, as data-parallel buckets go.
    let thread = CommThread::new(format!("bench-comm-{}", comm.rank()))?;
    let buffer = x.copy()?;
    let mark = comm.hand_off()?;
    let (c, g, b) = (comm.clone(), world.clone(), buffer.clone());
    let in_place_comm_thread_us = thread
        .submit(move || {
            let t0 = Instant::now();
            for _ in 0..calls {
                c.all_reduce_in_place(&g, &b, ReduceOp::Max, &mark)?;
            }
            Ok(t0.elapsed().as_secs_f64() * 1e6 / calls as f64)
        })?
        .wait()?;
    let r = comm.rank();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for _ in 0..20 {
        comm.send_recv(&world, &x, next, prev)?.wait()?;
    }
    crate::device::synchronize(device)?;
    let t0 = Instant::now();
    for _ in 0..calls {
        last = comm.send_recv(&world, &x, next, prev)?.wait()?;
    }
    crate::device::synchronize(device)?;
    let send_recv_us = per_call(t0);
    drop(last);
    comm.barrier(&world)?;
    Ok(CommTiming {
        backend,
        world: n,
        elements,
        all_reduce_us,
        all_reduce_done_us,
        in_place_comm_thread_us,
        send_recv_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_call_is_timed_on_thread_ranks() {
        let out = parallel::comm::local::run_local(2, Duration::from_secs(30), |_, comm| {
            measure(comm, &candle_core::Device::Cpu, "local", 50, 256)
        })
        .unwrap_or_else(|e| panic!("{}", e.error));
        for t in out {
            assert_eq!((t.world, t.elements), (2, 256));
            let times = [
                t.all_reduce_us,
                t.all_reduce_done_us,
                t.in_place_comm_thread_us,
                t.send_recv_us,
            ];
            assert!(times.iter().all(|&us| us > 0.0 && us.is_finite()), "{t:?}");
        }
    }
}
