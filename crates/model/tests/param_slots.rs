//! Parameter slots: packed matrices read as one stacked view and written in place, ZeRO-3's
//! installs as views of the gathered bucket, and the fused projections (one GEMM over q, k and
//! v; over gate and up) giving the same bits whether the weights lie packed (a view) or apart
//! (a stacked copy).

mod common;
use common::expect_err;

use candle_core::{DType, Device, Result, Tensor};
use model::init::Init;
use model::{Llama, LlamaConfig, ParamKind, ParamSet, ParamSpec, Piece, Placement, Targets};
use parallel::tp::TensorParallel;

/// Three matrices of 4 columns (rows 2, 3, 1) and a vector, with seeded values.
fn set() -> Result<ParamSet> {
    let mut set = ParamSet::default();
    for (name, shape) in [
        ("a.weight", vec![2, 4]),
        ("b.weight", vec![3, 4]),
        ("c.weight", vec![1, 4]),
        ("n.weight", vec![4]),
    ] {
        let spec = ParamSpec {
            name,
            global_shape: &shape,
            kind: ParamKind::Matrix,
            init: Init::Normal { std: 1.0 },
        };
        set.add(spec, 9, &TensorParallel::single(), DType::F32, &Device::Cpu)?;
    }
    Ok(set)
}

fn rows(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    t.to_vec2::<f32>()
}

#[test]
fn packed_matrices_stack_as_a_view_and_are_written_in_place() -> Result<()> {
    let set = set()?;
    let apart: Vec<Tensor> = (0..3)
        .map(|i| set.get(i).tensor()?.copy())
        .collect::<Result<_>>()?;
    let stacked = Tensor::cat(&apart, 0)?;
    // Apart, the stack is a copy in the order asked for.
    let copy = set.span(&[0, 1, 2])?;
    assert_eq!(rows(&copy)?, rows(&stacked)?);
    let reversed = set.span(&[2, 1, 0])?;
    assert_eq!(rows(&reversed.narrow(0, 0, 1)?)?, rows(&apart[2])?);
    set.pack(&[0, 1, 2])?;
    for (i, want) in apart.iter().enumerate() {
        assert_eq!(
            rows(&set.get(i).tensor()?)?,
            rows(want)?,
            "packing keeps values"
        );
    }
    let view = set.span(&[0, 1, 2])?;
    assert_eq!(rows(&view)?, rows(&stacked)?);
    // A new value of b lands in its rows of the packed storage, and nowhere else.
    let b = Tensor::full(7f32, (3, 4), &Device::Cpu)?;
    set.get(1).set(&b)?;
    let seen = rows(&view)?;
    assert_eq!(seen[0..2], rows(&apart[0])?[..], "a untouched");
    assert_eq!(
        seen[2..5],
        rows(&b)?[..],
        "the earlier view sees b's new rows"
    );
    assert_eq!(seen[5..6], rows(&apart[2])?[..], "c untouched");
    assert_eq!(rows(&copy)?, rows(&stacked)?, "a copy does not change");
    // Out of order, the stack is a copy again (the same values).
    let out_of_order = set.span(&[1, 0])?;
    assert_eq!(rows(&out_of_order.narrow(0, 0, 3)?)?, rows(&b)?);
    // A value read from a neighbour in the same storage is copied before it is written.
    set.get(2).set(&set.get(0).tensor()?.narrow(0, 0, 1)?)?;
    assert_eq!(
        rows(&set.get(2).tensor()?)?,
        rows(&apart[0].narrow(0, 0, 1)?)?
    );
    Ok(())
}

#[test]
fn installs_from_a_gathered_bucket_are_views_of_it() -> Result<()> {
    let set = set()?;
    let bucket = Tensor::arange(0f32, 40.0, &Device::Cpu)?; // [40]: a at 3, b at 11, c at 23
    set.get(0).install_from(&bucket, 3)?;
    set.get(1).install_from(&bucket, 11)?;
    set.get(2).install_from(&bucket, 23)?;
    let want: Vec<f32> = (3..27).map(|v| v as f32).collect();
    let stacked = set.span(&[0, 1, 2])?;
    assert_eq!(stacked.flatten_all()?.to_vec1::<f32>()?, want);
    // A view: writing b writes the bucket.
    set.get(1)
        .set(&Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?)?;
    let after = bucket.to_vec1::<f32>()?;
    assert!(after[11..23].iter().all(|&v| v == 0.0));
    assert_eq!(after[10], 10.0);
    assert_eq!(after[23], 23.0);
    // A gap between two ranges: the stack is a copy.
    let fresh = Tensor::arange(0f32, 40.0, &Device::Cpu)?;
    set.get(0).install_from(&fresh, 3)?;
    set.get(1).install_from(&fresh, 12)?;
    let gap = set.span(&[0, 1])?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(gap[7..9], [10.0, 12.0]);
    // Another dtype is cast into a slot of its own.
    let f64s = Tensor::arange(0f64, 40.0, &Device::Cpu)?;
    set.get(0).install_from(&f64s, 30)?;
    let a = set.get(0).tensor()?;
    assert_eq!(a.dtype(), DType::F32);
    assert_eq!(a.flatten_all()?.to_vec1::<f32>()?[0], 30.0);
    expect_err(set.get(0).install_from(&bucket, 35), "elements 35..43");
    expect_err(
        set.get(0)
            .install(&Tensor::zeros(5, DType::F32, &Device::Cpu)?),
        "installing 5 values into a block of 8",
    );
    expect_err(set.span(&[0, 3]), "n.weight ([4], F32) cannot be stacked");
    expect_err(set.pack(&[]), "stacking no parameters");
    set.get(2).release();
    expect_err(set.span(&[0, 1, 2]), "c.weight is not on this rank");
    Ok(())
}

/// A small grouped-query model: q 32 wide, k and v 16, gate and up 48.
fn config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 16,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        init_std: 0.02,
        ..Default::default()
    }
}

/// A block's output, input gradient and weight gradients (as `gᵀ · x`), flattened.
fn block_pass(model: &Llama, x: &Tensor, dy: &Tensor) -> Result<Vec<Vec<f32>>> {
    let dev = Device::Cpu;
    let n = x.dim(0)? * x.dim(1)?;
    let targets = Targets {
        labels: Tensor::zeros(n, DType::U32, &dev)?,
        loss_mask: Tensor::ones(n, DType::F32, &dev)?,
        loss_scale: 1.0,
        aux_scale: 0.0,
        documents: None,
    };
    let f = model.forward(Piece::Block(1), x, &targets)?;
    let mut out = vec![f.y.flatten_all()?.to_vec1::<f32>()?];
    let g = model.backward(f.tape, Some(dy))?;
    out.push(
        g.dx.expect("a block has an input")
            .flatten_all()?
            .to_vec1::<f32>()?,
    );
    let mut params = g.params;
    params.sort_by_key(|(i, _)| *i);
    for (_, pg) in params {
        out.push(pg.into_tensor()?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

#[test]
fn fused_projections_read_packed_and_apart_weights_alike() -> Result<()> {
    let (c, dev) = (config(), Device::Cpu);
    let packed = Llama::new(&c, Placement::whole(&c), 3, DType::F32, &dev)?;
    let apart = Llama::declare(&c, Placement::whole(&c), DType::F32, &dev)?;
    for (p, q) in packed.params().iter().zip(apart.params().iter()) {
        q.install(&p.tensor()?)?;
    }
    let x = Tensor::randn(0f32, 1.0, (2, 8, 32), &dev)?;
    let dy = Tensor::randn(0f32, 1.0, (2, 8, 32), &dev)?;
    let (a, b) = (block_pass(&packed, &x, &dy)?, block_pass(&apart, &x, &dy)?);
    assert!(a.iter().flatten().all(|v| v.is_finite()), "finite values");
    assert!(a == b, "packed and apart weights give different bits");
    Ok(())
}

#[test]
fn packing_at_a_layouts_offsets_gives_one_flat_tensor() -> Result<()> {
    let set = set()?;
    let before: Vec<Vec<f32>> = (0..4)
        .map(|i| set.get(i).tensor()?.flatten_all()?.to_vec1::<f32>())
        .collect::<Result<_>>()?;
    // Out of index order, with gaps: c at 0, a at 6, b at 14, n at 26; 32 in all.
    let offsets = [6, 14, 0, 26];
    set.pack_at(&offsets, 32)?;
    let flat = set.flat_at(&offsets, 32).expect("packed at the offsets");
    let v = flat.to_vec1::<f32>()?;
    for (i, want) in before.iter().enumerate() {
        assert_eq!(&v[offsets[i]..offsets[i] + want.len()], &want[..]);
        let got = set.get(i).tensor()?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(&got, want, "values unchanged");
    }
    assert!(
        v[4..6].iter().chain(&v[30..]).all(|&x| x == 0.0),
        "gaps are zero"
    );
    assert!(set.flat_at(&[6, 14, 0, 27], 32).is_none(), "other offsets");
    assert!(set.flat_at(&offsets, 33).is_none(), "another size");
    // Written through the flat tensor, read through the slots.
    flat.slice_set(&Tensor::full(2f32, 8, &Device::Cpu)?, 0, 6)?;
    assert_eq!(
        set.get(0).tensor()?.flatten_all()?.to_vec1::<f32>()?,
        vec![2.0; 8]
    );
    // A write through it drops the FP8 operands kept of the old values, as `set` does.
    let mode = (model::Fp8Scaling::Tensorwise, model::Fp8Gemm::Emulated);
    let p = set.get(1);
    p.fp8_operand(mode, |w| model::llama::fp8_weight_operand(w, mode))?;
    assert!(p.fp8_bytes() > 0);
    assert!(set.write_flat(&offsets, 32, |t| t.slice_set(&t.ones_like()?, 0, 0))?);
    assert_eq!(
        p.fp8_bytes(),
        0,
        "the packed write dropped the kept operand"
    );
    assert!(set
        .get(1)
        .tensor()?
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|&v| v == 1.0));
    assert!(!set.write_flat(&offsets, 33, |_| unreachable!("not packed so"))?);
    // A parameter installed elsewhere leaves it.
    set.get(3)
        .install(&Tensor::zeros(4, DType::F32, &Device::Cpu)?)?;
    assert!(set.flat_at(&offsets, 32).is_none());
    expect_err(set.pack_at(&[0, 4, 30, 26], 32), "cannot be packed at 4");
    expect_err(set.pack_at(&[0, 8], 32), "2 offsets for 4 parameters");
    Ok(())
}
